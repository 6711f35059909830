import os
import signal

# Triton kernels run on CPU tensors only through the interpreter, and the switch must be set before
# any @triton.jit decorator runs. A machine with CUDA runs the real kernels instead.
def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
SHARED_DATA = os.path.join(SHARED, "data")
# The native ops' instruction-set paths; the `cpu_isa` fixture runs a test on each this CPU has.
CPU_ISAS = ("avx512", "avx2", "scalar")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shared_data() -> str:
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(autouse=True, scope="session")
def python_ctrl_c_handler():
    """Python's own Ctrl-C handler, as in a terminal: a shell starts background jobs with SIGINT
    ignored, and Python then keeps it ignored, so the tests that send Ctrl-C would test nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def assert_usage_errors(base: list[str], cases: list[tuple[list[str], str]], capsys, unwritten) -> None:
    """Each `base + extra` exits with code 2 and one stderr line holding its message; `unwritten`
    (the output folder) is never created."""
    from elsi_fast.cli import main

    capsys.readouterr()
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not unwritten.exists()


def catalog_file(name: str):
    """The GGUF file of a named real target (elsi_fast.targets.catalog); the test is skipped when its
    package is not installed."""
    from elsi_fast.targets import catalog

    try:
        return catalog.resolve(name)
    except ValueError as error:
        pytest.skip(str(error))


# The two real pretrained targets (elsi_fast.targets.catalog), loaded once per session: the first load in a
# fresh cache dequantizes the GGUF file (about 1 minute for SmolLM2, 3 for Gemma 3 on 2 cores).
@pytest.fixture(scope="session")
def smollm2():
    from elsi_fast.targets.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def gemma3():
    from elsi_fast.targets.loading import load_model

    return load_model("gemma3-270m", device="cpu", dtype="float32", progress=False)


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Selects each instruction-set path of the native ops in turn (skipped where the CPU lacks it)."""
    from elsi_fast import _C

    previous = _C.cpu_isa()
    if not _C.set_cpu_isa(request.param):
        pytest.skip(f"this CPU lacks {request.param}")
    yield request.param
    assert _C.set_cpu_isa(previous)


@pytest.fixture(scope="session")
def replay_setup(tmp_path_factory):
    """A trained draft of the tiny target, the target's greedy continuations of 6 prompts, and
    their feature cache (the replay tests of decoding.evaluation and bench.draft_copy)."""
    from elsi_fast.analysis.prompts import Prompt
    from elsi_fast.decoding import evaluation
    from elsi_fast.training.train import train_draft
    from tiny_lm import SMALL, TARGET, TEXTS, TOKENIZER
    from elsi_fast.training.feature_cache import build
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations, regenerate
    from tiny_lm import conversation_samples_of_tiny_target

    tmp_path = tmp_path_factory.mktemp("replay")
    samples = conversation_samples_of_tiny_target(tmp_path / "train", count=16, max_new_tokens=16)
    draft, _ = train_draft(TARGET, TOKENIZER, [2, 4], samples, out_dir=tmp_path / "draft",
                           **{**SMALL, "steps": 40, "lr": 1e-2, "batch_size": 4})
    prompts = [Prompt(text=TEXTS[(i * 5) % len(TEXTS)][3 + i : 30 + 4 * i], id=str(i), category=f"c{i % 2}", chat=True)
               for i in range(6)]
    regenerate(TARGET, TOKENIZER, prompts, tmp_path / "eval", max_new_tokens=20, batch_size=3, progress=False)
    records = read_conversations(tmp_path / "eval" / CONVERSATIONS_FILE)
    cache = build(TARGET, evaluation.continuation_samples(records), [1, 2, 4], tmp_path / "cache", progress=False)
    return draft, records, cache
