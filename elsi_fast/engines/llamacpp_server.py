"""llama.cpp's `llama-server` as a generation engine: N parallel slots with continuous batching on
localhost, fed token ids and answering token ids.

On SmolLM2 (Q4_1 file, 2 threads, 16 slots) it sampled 96-token user turns at 162 new tokens/s
(2026-12-04, AMD EPYC Zen 4), about twice transformers' batched `generate` on the dequantized fp32
model; its weights are the GGUF file's quantized ones, so its answers can differ from a
transformers run of the same file (fine for training data; the records name the engine).
Stdlib only (urllib, threads), so the regenerate path imports nothing new.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Iterator, Sequence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A `llama-server` process serving `gguf` with `slots` parallel sequences of `context` tokens each.

    Use as a context manager; `generate` sends token-id prompts and yields their answers."""

    ENGINE = "llama.cpp"  # the name regenerate.json and self_instruct.json record

    def __init__(self, binary: str | os.PathLike, gguf: str | os.PathLike, *, slots: int = 16, context: int = 1024,
                 threads: int = 2, start_timeout: float = 120.0):
        binary, gguf = Path(binary), Path(gguf)
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise ValueError(f"llama_server: {binary} is not an executable llama-server")
        if not gguf.is_file():
            raise ValueError(f"gguf: no such file: {gguf}")
        self.slots, self.port = slots, _free_port()
        self._log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="llama-server-")
        self._process = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(slots * context), "-t", str(threads),
             "--host", "127.0.0.1", "--port", str(self.port), "-cb", "--no-webui"],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while True:
            if self._process.poll() is not None:
                self._log.seek(0)
                tail = self._log.read().strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"llama_server: exited with {self._process.returncode}: {tail[0][:300]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama_server: not ready after {start_timeout:.0f} s")
            time.sleep(0.25)

    def _complete(self, prompt: list[int], max_new_tokens: int, temperature: float, seed: int) -> tuple[list[int], bool]:
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0} if temperature > 0 else \
            {"temperature": 0.0, "top_k": 1}
        body = json.dumps({"prompt": prompt, "n_predict": max_new_tokens, "seed": seed, "return_tokens": True,
                           "cache_prompt": True, **sampling}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            answer = json.loads(r.read())
        return list(answer["tokens"]), answer.get("stop_type") == "eos"

    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float, seeds: Sequence[int],
                 stop: Sequence[int]) -> Iterator[tuple[int, list[int]]]:
        """(prompt index, new tokens) in the order they finish, cut after the first of `stop`; an
        answer the server ended at an end-of-generation token it left out gets stop[0] appended."""
        pool = ThreadPoolExecutor(self.slots)
        try:
            pending = {pool.submit(self._complete, p, max_new_tokens, temperature, s): i
                       for i, (p, s) in enumerate(zip(prompts, seeds))}
            for future in as_completed(pending):
                tokens, at_eos = future.result()
                cut = next((k + 1 for k, t in enumerate(tokens) if t in stop), None)
                yield pending[future], tokens[:cut] if cut else tokens + [stop[0]] if at_eos else tokens
        finally:  # a caller that stops reading (Ctrl-C) waits only for the requests under way
            pool.shutdown(wait=True, cancel_futures=True)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
