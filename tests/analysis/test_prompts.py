"""Prompt loading: Spec-Bench / MT-bench JSONL, text, folders, chat templates, bad files."""

import json
import os

import pytest

from elsi_fast.analysis.prompts import Prompt, encode_prompt, load_prompts


def test_spec_bench_jsonl(shared_data):
    prompts = load_prompts(os.path.join(shared_data, "prompts", "spec_bench_question.jsonl"))
    assert len(prompts) == 480
    assert prompts[0].id == "81" and prompts[0].category == "writing" and prompts[0].chat
    assert prompts[0].text.startswith("Compose an engaging travel blog post")
    categories = {p.category for p in prompts}
    assert {"translation", "summarization", "qa", "math_reasoning", "rag"} <= categories
    assert len(load_prompts(os.path.join(shared_data, "prompts", "mt_bench_question.jsonl"), max_prompts=5)) == 5


def test_text_file_paragraphs_and_folder(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("First paragraph\nstill first.\n\n\nSecond one.\n\n")
    prompts = load_prompts(str(text))
    assert [p.text for p in prompts] == ["First paragraph\nstill first.", "Second one."]
    assert not prompts[0].chat
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "b.txt").write_text("beta")
    (folder / "a.txt").write_text("alpha")
    (folder / "skip.md").write_text("not a prompt")
    assert [p.text for p in load_prompts(str(folder))] == ["alpha", "beta"]


def test_jsonl_prompt_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hello", "id": 3}) + "\n\n" + json.dumps({"text": "bye"}) + "\n")
    prompts = load_prompts(str(path))
    assert [(p.text, p.id) for p in prompts] == [("hello", "3"), ("bye", None)]


@pytest.mark.parametrize(
    "content, match",
    [
        ("", "no prompts"),
        ("{not json\n", "invalid JSON"),
        ('{"turns": []}\n', "turns"),
        ('{"other": 1}\n', "'turns' list or a 'prompt'"),
        ("[1, 2]\n", "JSON object"),
    ],
)
def test_bad_jsonl(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_prompts(str(path))


def test_missing_unreadable_and_empty_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such"):
        load_prompts(str(tmp_path / "nope.jsonl"))
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ValueError, match="UTF-8"):
        load_prompts(str(binary))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="no .txt"):
        load_prompts(str(empty_dir))
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(blank))
    with pytest.raises(ValueError, match="max_prompts"):
        load_prompts(str(blank), max_prompts=0)


class CharTokenizer:
    """Characters as ids, BOS=1; optional chat template that wraps the user message."""

    def __init__(self, chat_template=None):
        self.chat_template = chat_template
        self.rendered = []

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt and messages[0]["role"] == "user"
        rendered = f"<U>{messages[0]['content']}<A>"
        self.rendered.append(rendered)
        return rendered


def test_encode_prompt_chat_template_only_for_instructions():
    plain = CharTokenizer()
    assert encode_prompt("hi", plain) == [1, ord("h"), ord("i")]
    assert encode_prompt(Prompt("hi", chat=True), plain) == [1, ord("h"), ord("i")]  # no template
    chat = CharTokenizer(chat_template="{{ messages }}")
    ids = encode_prompt(Prompt("hi", chat=True), chat)
    assert ids == [ord(c) for c in "<U>hi<A>"]  # the template carries its own markers: no extra BOS
    assert encode_prompt(Prompt("hi"), chat) == [1, ord("h"), ord("i")]  # plain text stays plain
    assert encode_prompt(Prompt("x", input_ids=[1, 7]), chat) == [1, 7]


def test_load_with_tokenizer_fills_ids(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"turns": ["ab", "second turn"], "category": "c"}) + "\n")
    (prompt,) = load_prompts(str(path), tokenizer=CharTokenizer())
    assert prompt.input_ids == [1, ord("a"), ord("b")]  # first turn only


def test_spread_over_categories_takes_each_category_in_turn(shared_data):
    from collections import Counter

    from elsi_fast.analysis.prompts import spread_over_categories

    spec = load_prompts(os.path.join(shared_data, "prompts", "spec_bench_question.jsonl"))
    categories = Counter(p.category for p in spec)
    picked = spread_over_categories(spec, 120)
    counts = Counter(p.category for p in picked)
    assert len(picked) == 120 and set(counts) == set(categories)
    assert max(counts.values()) - min(counts.values()) <= 1  # 120 over 13 categories: 9 or 10 each
    positions = [spec.index(p) for p in picked]
    assert positions == sorted(positions)  # file order
    first = {c: [p for p in spec if p.category == c][: counts[c]] for c in categories}
    assert all(p in first[p.category] for p in picked)  # each category's first prompts
    assert spread_over_categories(spec, 10_000) == spec
    plain = [type(spec[0])(text=f"t{i}") for i in range(5)]
    assert spread_over_categories(plain, 3) == plain[:3]
    with pytest.raises(ValueError, match="n: must be >= 1"):
        spread_over_categories(spec, 0)


def test_fitting_gram_tokens_is_the_largest_cap_that_fits():
    from elsi_fast.analysis.analyze import fitting_gram_tokens

    lengths = [3, 40, 17, 90, 250]
    token_ids = [[0] * n for n in lengths]
    layers, dim, itemsize = 7, 64, 4

    def size(cap):  # the store's spill: n x min(n, dim) numbers a layer, n = kept tokens (all but position 0)
        return sum(layers * k * min(k, dim) * itemsize for k in (min(n - 1, cap) for n in lengths))

    full = size(10**9)
    assert fitting_gram_tokens(token_ids, layers, dim, itemsize, full) is None
    assert fitting_gram_tokens(token_ids, layers, dim, itemsize, full, gram_tokens=50) == 50
    for bound in (size(2), size(30), size(30) + 1, size(31) - 1, full - 1):
        cap = fitting_gram_tokens(token_ids, layers, dim, itemsize, bound)
        assert size(cap) <= bound < size(cap + 1), (bound, cap)
    assert fitting_gram_tokens(token_ids, layers, dim, itemsize, size(30), gram_tokens=20) == 20
    with pytest.raises(ValueError, match="max_store_bytes: .* cannot hold even 2 tokens"):
        fitting_gram_tokens(token_ids, layers, dim, itemsize, size(2) - 1)
