"""The vLLM side of `regenerate(..., engine="vllm")`: run by the vLLM environment's Python, it
imports only the standard library and vllm (not elsi_fast, which that environment may lack).

    python _vllm_generate.py JOB.json    # answers on stdout, one JSON line each, chunk by chunk

JOB: {"model", "dtype", "max_model_len", "max_num_seqs", "chunk", "prompts": [[ids]...],
"keys": [...], "max_new_tokens", "stop_token_ids", "temperature", "seeds": [...] | null}.
Each line: {"key", "tokens", "finish_reason", "stop_reason"}. Writing every chunk as soon as it is
generated lets the caller keep what arrived when it is interrupted.
"""

import json
import os
import sys

# Run as a script, this file's folder (elsi_fast/training/) is sys.path[0], and its modules would
# shadow installed top-level modules of the same names for vLLM and transformers (transformers 5.25
# imports the `kernels` distribution; elsi_fast/kernels/ took its place when this file lay in
# elsi_fast/, and the worker failed).
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def main(job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    # vLLM logs to stdout: the answers keep the real stdout, everything else goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], seed=0, enforce_eager=True)  # measured eager; compiling takes minutes
    for start in range(0, len(job["prompts"]), job["chunk"]):
        prompts = job["prompts"][start : start + job["chunk"]]
        params = []
        for i in range(start, start + len(prompts)):
            sampling = ({"temperature": job["temperature"], "top_p": 1.0, "top_k": -1, "seed": job["seeds"][i]}
                        if job["temperature"] > 0 else {"temperature": 0.0})
            params.append(SamplingParams(max_tokens=job["max_new_tokens"], stop_token_ids=job["stop_token_ids"],
                                         **sampling))
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
        for i, output in zip(range(start, start + len(prompts)), outputs):
            completion = output.outputs[0]
            stop_reason = completion.stop_reason if isinstance(completion.stop_reason, int) else None
            print(json.dumps({"key": job["keys"][i], "tokens": list(completion.token_ids),
                              "finish_reason": completion.finish_reason, "stop_reason": stop_reason}),
                  file=answers, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
