"""The llama-server client (elsi_fast.engines.llamacpp_server) against a stand-in server written here: the
requests it sends (token-id prompts, seeds, greedy or sampled settings), answers cut after the first
stop id, the end-of-generation token appended where the server leaves it out, and errors named."""

from __future__ import annotations

import json
import stat
import sys
import textwrap

import pytest

from elsi_fast.engines.llamacpp_server import LlamaServer

# Answers the prompt's last token + 1, + 2, ... ; a prompt whose last token is 7 gets [8, 9, 3, 4]
# (a stop id inside), one ending in 50 stops at "eos" after [51] (the EOG token not returned).
FAKE = textwrap.dedent('''\
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    log = open(args[args.index("-m") + 1] + ".requests", "a")
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def _send(self, obj):
            body = json.dumps(obj).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def do_GET(self): self._send({"status": "ok"})
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            log.write(json.dumps(req) + "\\n"); log.flush()
            last = req["prompt"][-1]
            if last == 7:
                self._send({"tokens": [8, 9, 3, 4], "stop_type": "limit"})
            elif last == 50:
                self._send({"tokens": [51], "stop_type": "eos"})
            else:
                self._send({"tokens": [last + i for i in range(1, req["n_predict"] + 1)], "stop_type": "limit"})
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture()
def fake(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + FAKE)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return script, gguf


def test_answers_are_cut_at_stop_ids_and_eos_is_appended(fake):
    script, gguf = fake
    with LlamaServer(script, gguf, slots=3, context=64, threads=1) as server:
        out = dict(server.generate([[1, 7], [2, 50], [10, 20]], 3, 0.0, [5, 6, 7], stop=[3, 99]))
    assert out == {0: [8, 9, 3], 1: [51, 3], 2: [21, 22, 23]}
    requests = [json.loads(line) for line in (gguf.parent / "model.gguf.requests").read_text().splitlines()]
    assert sorted(r["seed"] for r in requests) == [5, 6, 7]
    assert all(r["n_predict"] == 3 and r["temperature"] == 0.0 and r["top_k"] == 1 for r in requests)
    assert sorted(r["prompt"] for r in requests) == [[1, 7], [2, 50], [10, 20]]


def test_sampled_requests_use_the_plain_distribution(fake):
    script, gguf = fake
    with LlamaServer(script, gguf, slots=1, context=64, threads=1) as server:
        list(server.generate([[1]], 2, 1.0, [0], stop=[3]))
    request = json.loads((gguf.parent / "model.gguf.requests").read_text().splitlines()[0])
    assert (request["temperature"], request["top_k"], request["top_p"], request["min_p"]) == (1.0, 0, 1.0, 0.0)


def test_bad_binary_or_model_is_named(tmp_path, fake):
    script, gguf = fake
    with pytest.raises(ValueError, match="llama_server: .* is not an executable"):
        LlamaServer(tmp_path / "nope", gguf)
    with pytest.raises(ValueError, match="gguf: no such file"):
        LlamaServer(script, tmp_path / "nope.gguf")
    dead = tmp_path / "dead"
    dead.write_text("#!/bin/sh\necho 'error: unknown model format' >&2\nexit 3\n")
    dead.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with 3: error: unknown model format"):
        LlamaServer(dead, gguf, start_timeout=20)


def test_regenerate_and_self_instruct_write_the_servers_answers(fake, tmp_path):
    from elsi_fast.analysis.prompts import Prompt, encode_prompt
    from elsi_fast.training import regenerate as regen
    from tiny_lm import TARGET, TEXTS, TOKENIZER

    script, gguf = fake
    prompts = [Prompt(text=TEXTS[i][:25], id=f"p{i}", chat=True) for i in range(4)]
    with pytest.raises(ValueError, match="server: engines .llama.cpp. and .native."):
        regen.regenerate(TARGET, TOKENIZER, prompts, tmp_path / "x", engine="llama.cpp")
    with LlamaServer(script, gguf, slots=2, context=64, threads=1) as server:
        regen.regenerate(TARGET, TOKENIZER, prompts[:2], tmp_path / "a", max_new_tokens=3, engine="llama.cpp",
                         server=server, progress=False)
        grown = regen.regenerate(TARGET, TOKENIZER, prompts, tmp_path / "a", max_new_tokens=3, engine="llama.cpp",
                                 server=server, progress=False)
    assert grown["answered_now"] == 2
    stop = regen._stop_ids(TARGET, TOKENIZER)
    for record in regen.read_conversations(tmp_path / "a" / regen.CONVERSATIONS_FILE):
        last = encode_prompt(prompts[int(record["id"][1:])], TOKENIZER)[-1]
        expected = [last + 1, last + 2, last + 3]
        cut = next((k + 1 for k, t in enumerate(expected) if t in stop), 3)
        assert record["response_ids"] == expected[:cut]
    settings = json.loads((tmp_path / "a" / regen.SETTINGS_FILE).read_text())
    assert settings["engine"] == "llama.cpp"
