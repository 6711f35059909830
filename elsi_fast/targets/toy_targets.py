"""Small Llama-architecture target models trained from scratch on the CPU, reproducibly, and cached.

A `TargetRecipe` fixes everything that determines the result: the text source, the tokenizer's
vocabulary size, the model shape and the optimisation schedule. `build_target(recipe)` trains a
byte-level BPE tokenizer (the `tokenizers` library) and a `LlamaForCausalLM` on that text, and
saves both with `save_pretrained` under the cache directory, keyed by a hash of the recipe and of
the text itself, so a second call reuses the result. Two recipes ship:

- `NATURAL_LANGUAGE`: the plain-text corpus in ``../shared/data/corpus`` (stories, novels,
  Shakespeare, Wikipedia), with the tail of every file held out for evaluation.
- `DEMO`: the Python standard library's top-level ``.py`` sources, which every Python installation
  has, so the offline demo downloads nothing.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sysconfig
import time
from pathlib import Path

import torch

from .._infra.cache import cache_root
from .._infra.state_files import load_state, save_state

# Bump when the training procedure changes in a way the recipe fields do not capture.
_RECIPE_FORMAT = 1
EOS_TOKEN = "<|endoftext|>"
TRAIN_STATE_FILE = "train_state.pt"
STDLIB = "stdlib"


@dataclasses.dataclass(frozen=True)
class TargetRecipe:
    """Everything that determines a trained target.

    `source` is a directory of ``.txt`` files (read in sorted order) or ``"stdlib"`` for the
    standard library's top-level ``.py`` files. The last `holdout_fraction` of every document is
    never trained on (`heldout_texts` returns it). `max_chars` caps the training text.
    """

    name: str
    source: str
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 12
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 400
    lr: float = 3e-3
    warmup: int = 40
    weight_decay: float = 0.01
    holdout_fraction: float = 0.05
    max_chars: int = 4_000_000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_hidden_layers < 1 or self.hidden_size < 1 or self.vocab_size < 300:
            raise ValueError(
                "TargetRecipe: num_hidden_layers and hidden_size must be >= 1 and vocab_size >= 300 "
                f"(256 byte symbols + merges), got {self.num_hidden_layers}, {self.hidden_size}, "
                f"{self.vocab_size}"
            )
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "TargetRecipe: hidden_size must divide by num_attention_heads and num_attention_heads "
                f"by num_key_value_heads, got {self.hidden_size}, {self.num_attention_heads}, "
                f"{self.num_key_value_heads}"
            )
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"TargetRecipe: holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError(
                f"TargetRecipe: steps and batch_size must be >= 1 and seq_len >= 2, got "
                f"{self.steps}, {self.batch_size}, {self.seq_len}"
            )


def _shared_corpus_dir() -> str:
    return str(Path(__file__).resolve().parents[3] / "shared" / "data" / "corpus")


# 12 blocks of width 128: the paper's effects are about depth, so depth is kept and width is cut.
NATURAL_LANGUAGE = TargetRecipe(
    name="corpus-nl", source=_shared_corpus_dir(), vocab_size=4096, hidden_size=128,
    intermediate_size=384, num_attention_heads=4, num_key_value_heads=4, steps=600, batch_size=16,
    seq_len=128, lr=3e-3, warmup=50,
)
# The demo target must train in a few minutes on two cores on a fresh machine.
DEMO = TargetRecipe(
    name="stdlib-demo", source=STDLIB, vocab_size=2048, hidden_size=128, intermediate_size=384,
    num_attention_heads=4, num_key_value_heads=2, steps=300, batch_size=16, seq_len=128, lr=3e-3,
    warmup=30, max_chars=2_000_000,
)


def _documents(recipe: TargetRecipe) -> list[str]:
    """The source text as a list of documents, in a fixed order, capped at `recipe.max_chars`."""
    if recipe.source == STDLIB:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = sorted(root.glob("*.py"))
    else:
        root = Path(recipe.source)
        if not root.is_dir():
            raise FileNotFoundError(f"TargetRecipe.source: {recipe.source!r} is not a directory")
        paths = sorted(root.glob("*.txt"))
    if not paths:
        raise ValueError(f"TargetRecipe.source: no text files found under {root}")
    # Round-robin over files so a character cap keeps every source represented.
    per_file = max(1, recipe.max_chars // len(paths))
    docs = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        docs.append(text[:per_file] if len(text) > per_file else text)
    return docs


def _split(doc: str, holdout_fraction: float) -> tuple[str, str]:
    cut = len(doc) - int(len(doc) * holdout_fraction)
    # Cut at a line boundary so held-out text starts cleanly.
    newline = doc.rfind("\n", 0, cut)
    if newline > 0 and holdout_fraction > 0:
        cut = newline + 1
    return doc[:cut], doc[cut:]


def training_texts(recipe: TargetRecipe) -> list[str]:
    """The documents the recipe trains on (each document minus its held-out tail)."""
    return [_split(d, recipe.holdout_fraction)[0] for d in _documents(recipe)]


def heldout_texts(recipe: TargetRecipe) -> list[str]:
    """The held-out tail of every source document (empty documents dropped)."""
    return [t for t in (_split(d, recipe.holdout_fraction)[1] for d in _documents(recipe)) if t.strip()]


def recipe_key(recipe: TargetRecipe) -> str:
    """Hash of the recipe fields and of the training text: the cache key."""
    h = hashlib.sha256()
    fields = dataclasses.asdict(recipe)
    fields["source"] = STDLIB if recipe.source == STDLIB else "dir"
    h.update(json.dumps({"format": _RECIPE_FORMAT, **fields}, sort_keys=True).encode())
    for doc in training_texts(recipe):
        h.update(hashlib.sha256(doc.encode("utf-8", errors="replace")).digest())
    return h.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on `texts`, wrapped as a `PreTrainedTokenizerFast`.

    Its only special token, ``<|endoftext|>``, is id 0 and serves as BOS, EOS and padding; with
    ``add_special_tokens=True`` (the default) an encoding starts with it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Encoded prompts start with the separator, as every training document does in the stream.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS_TOKEN} $A", pair=f"{EOS_TOKEN} $A {EOS_TOKEN} $B",
        special_tokens=[(EOS_TOKEN, tok.token_to_id(EOS_TOKEN))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
    )


def _llama_config(recipe: TargetRecipe, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=max(2048, recipe.seq_len), rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def train_target(
    recipe: TargetRecipe, out_dir: str | os.PathLike, *, progress: bool = True, save_every: int = 25
) -> dict:
    """Train the recipe's tokenizer and model and `save_pretrained` both into `out_dir`.

    Seeded: the same recipe on the same machine and thread count gives the same weights. The
    training state (model, optimizer, schedule, sampler) is saved to ``out_dir/train_state.pt``
    every `save_every` steps and when Ctrl-C arrives; a later call with the same recipe and
    `out_dir` continues from it and ends with the weights an uninterrupted run gives (at the same
    thread count).
    Returns the training summary that is also written to ``out_dir/recipe.json``.
    """
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    from .._infra.interrupt import DeferredInterrupt
    from ..training.train import warmup_cosine  # training imports targets: only here, at run time
    from ..training.training_data import token_stream

    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / TRAIN_STATE_FILE
    texts = training_texts(recipe)
    tokenizer = train_tokenizer(texts, recipe.vocab_size)
    stream = token_stream(tokenizer, texts)
    window = recipe.seq_len + 1
    if stream.numel() < window:
        raise ValueError(f"TargetRecipe: the text has {stream.numel()} tokens, fewer than seq_len + 1 = {window}")

    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(_llama_config(recipe, tokenizer))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr, betas=(0.9, 0.95),
    )

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, recipe.warmup, recipe.steps))
    gen = torch.Generator().manual_seed(recipe.seed)
    offsets = torch.arange(window)
    losses: list[float] = []
    # The stream's hash guards against a tokenizer that trained differently since the state was saved.
    identity = {"key": recipe_key(recipe), "stream": hashlib.sha256(stream.numpy().tobytes()).hexdigest()}
    if state_path.is_file():
        state = load_state(state_path, "the toy target's training state")
        if state["identity"] == identity:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            gen.set_state(state["generator"])
            losses = list(state["losses"])

    def save() -> None:
        save_state({"identity": identity, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "generator": gen.get_state(), "losses": losses}, state_path)

    bar = tqdm(total=recipe.steps, initial=len(losses),
               desc=f"train target {recipe.name} (threads: {torch.get_num_threads()})", disable=not progress)
    with DeferredInterrupt("the target's training state") as interrupt:
        while len(losses) < recipe.steps:
            starts = torch.randint(0, stream.numel() - window + 1, (recipe.batch_size,), generator=gen)
            batch = stream[starts[:, None] + offsets]
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if (len(losses) % save_every == 0 and len(losses) < recipe.steps) or interrupt.requested:
                save()
            interrupt.raise_if_requested()
    bar.close()
    model.eval()

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tail = losses[-max(1, len(losses) // 10):]
    summary = {
        "recipe": dataclasses.asdict(recipe), "key": recipe_key(recipe),
        "train_tokens": int(stream.numel()), "final_loss": sum(tail) / len(tail),
        "first_loss": losses[0], "seconds_this_run": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
    }
    (out / "recipe.json").write_text(json.dumps(summary, indent=2))
    state_path.unlink(missing_ok=True)
    return summary


def target_dir(recipe: TargetRecipe, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `build_target` keeps this recipe's model."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "targets" / f"{recipe.name}-{recipe_key(recipe)}"


def build_target(
    recipe: TargetRecipe, *, cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """Train the recipe's target unless a cached copy exists; return its directory.

    Training happens in a sibling directory ``.<name>.partial`` renamed into place when complete,
    so an interrupted build never leaves a half-written model that a later call would reuse, and
    the next call continues the interrupted training from its last saved step. A lock file keeps
    two processes from training the same target at once (the second waits, then reuses it).
    """
    final = target_dir(recipe, cache_dir)
    if (final / "recipe.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "recipe.json").is_file():  # another process built it while we waited
            return final
        partial = final.parent / f".{final.name}.partial"
        train_target(recipe, partial, progress=progress)
        if final.exists():  # a build without recipe.json: never complete, so replaced
            shutil.rmtree(final)
        os.replace(partial, final)
    return final


def load_target(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) from a directory written by `build_target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def build_demo_target(*, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """The offline demo's target (standard-library Python), trained on first use."""
    return build_target(DEMO, cache_dir=cache_dir, progress=progress)
