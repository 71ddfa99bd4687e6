"""``--chat-template``: chat records rendered with the model's own Jinja template, checked against
transformers' ``apply_chat_template`` on small tokenizers built here (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from csbp.data.artifact import open_artifact
from csbp.data.chat_template import ChatTemplate, resolve_chat_template
from csbp.data.packing import encode_documents
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.data.sources import record_to_document
from csbp.data.tokenizer import load_tokenizer

# Written for these tests in the style of the Qwen2.5-Instruct (ChatML, default system prompt) and
# Llama-3-Instruct (header ids, bos_token, trimmed content, strict alternation) templates.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' and loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'user' %}"
    "{{ raise_exception('two user turns in a row') }}"
    "{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = {
    "chatml": ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|end_of_text|>", "<|mask|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
}
CONFIGS = {
    "chatml": {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None},
    "llama3": {"chat_template": LLAMA3, "eos_token": "<|eot_id|>", "bos_token": "<|begin_of_text|>"},
}
CORPUS = ["You are a helpful assistant.", "What is two plus two?", "It is four.", "Name a colour.", "Blue."] * 20
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue, like the sky."},
]


def build_tokenizer_dir(directory: Path, style: str) -> Path:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS[style],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(CONFIGS[style]), encoding="utf-8")
    return directory


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def style_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, build_tokenizer_dir(tmp_path_factory.mktemp(request.param), request.param)


def hf_tokenizer(directory: Path, style: str) -> Any:  # transformers.PreTrainedTokenizerFast
    # transformers is a dev extra: skipped, like tests/test_hf_io.py, where it is missing (a device image)
    PreTrainedTokenizerFast = pytest.importorskip("transformers").PreTrainedTokenizerFast  # noqa: N806

    config = CONFIGS[style]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token=config["bos_token"], eos_token=config["eos_token"]
    )
    tokenizer.chat_template = config["chat_template"]
    return tokenizer


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_and_ids_equal_transformers(style_dir, add_generation_prompt: bool) -> None:
    style, directory = style_dir
    template = resolve_chat_template("auto", directory)
    assert template is not None and template.source.endswith("tokenizer_config.json")
    hf = hf_tokenizer(directory, style)
    for messages in (CHAT, CHAT[1:3], CHAT[1:2]):
        ours = template.render(messages, add_generation_prompt=add_generation_prompt)
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs
        ids = load_tokenizer(directory).encode(ours)
        hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
        assert ids == list(hf_ids)


def test_supervised_tokens_are_assistant_contents_and_end_of_turn(style_dir) -> None:
    style, directory = style_dir
    tokenizer = load_tokenizer(directory)
    template = resolve_chat_template("auto", directory)
    end_of_turn = "<|im_end|>" if style == "chatml" else "<|eot_id|>"
    document = record_to_document({"messages": CHAT}, "chat.jsonl:1")
    [(ids, mask)] = encode_documents([document], tokenizer, template)
    # the whole render, then the (unsupervised) EOS document separator
    assert ids[:-1].tolist() == tokenizer.encode(template.render(CHAT))
    assert ids[-1] == tokenizer.eos_id and mask[-1] == 0
    # supervised runs, decoded, are exactly each assistant content + its end-of-turn token
    runs, current = [], []
    for token, supervised in zip(ids.tolist(), mask.tolist()):
        if supervised:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    assert runs == [m["content"] + end_of_turn for m in CHAT if m["role"] == "assistant"]
    # nothing of the system/user turns is supervised
    unsupervised = tokenizer.decode([t for t, s in zip(ids.tolist(), mask.tolist()) if not s])
    for message in CHAT:
        if message["role"] != "assistant":
            assert message["content"] in unsupervised


@pytest.mark.parametrize("content", ["a", "", "  spaced out  ", "<|im_end|>"])
def test_assistant_contents_that_occur_in_the_scaffolding(style_dir, content: str) -> None:
    # "a" occurs in "assistant"; "" has no text to find: only the end-of-turn token is supervised
    style, directory = style_dir
    template = resolve_chat_template("auto", directory)
    end_of_turn = "<|im_end|>" if style == "chatml" else "<|eot_id|>"
    shown = content.strip() if style == "llama3" else content  # the Llama-3 style trims contents
    messages = [CHAT[1], {"role": "assistant", "content": content}]
    text, spans, _ = template.supervised_spans(messages, "rec:1")
    assert text == hf_tokenizer(directory, style).apply_chat_template(messages, tokenize=False)
    assert [text[a:b] for a, b in spans] == [shown + end_of_turn]


def test_prepare_records_the_template_and_none_keeps_role_markers(tmp_path: Path) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"text": "Blue."}) + "\n", encoding="utf-8")
    config = PrepareConfig(inputs=(data,), out_dir=tmp_path / "art", seq_len=8, tokenizer_path=directory)
    manifest = prepare_artifact(config)
    expected = ChatTemplate(CHATML, str(directory / "tokenizer_config.json")).sha256
    assert manifest["chat_template"]["sha256"] == expected
    artifact = open_artifact(tmp_path / "art", verify=True)
    assert artifact.chat_template == manifest["chat_template"]
    tokens = np.asarray(artifact.split("train").tokens).reshape(-1)
    im_start = load_tokenizer(directory).backend.token_to_id("<|im_start|>")
    assert int((tokens == im_start).sum()) == len(CHAT)
    # text-only inputs: the template formats nothing and is not recorded
    text_only = tmp_path / "text.jsonl"
    text_only.write_text(json.dumps({"text": "Blue."}) + "\n", encoding="utf-8")
    plain = PrepareConfig(inputs=(text_only,), out_dir=tmp_path / "plain", seq_len=2, tokenizer_path=directory)
    assert prepare_artifact(plain)["chat_template"] is None
    # none: today's role markers, which this tokenizer lacks -> the existing one-line error
    none = PrepareConfig(
        inputs=(data,), out_dir=tmp_path / "none", seq_len=8, tokenizer_path=directory, chat_template="none"
    )
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: chat data needs the role marker"):
        prepare_artifact(none)


def test_a_directory_given_as_the_template_file_says_so(tmp_path: Path) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    with pytest.raises(ValueError, match=r"--chat-template .* is a directory; .*or auto"):  # was "no such file"
        resolve_chat_template(str(directory), directory)


def test_a_template_file_not_in_utf8_is_named(tmp_path: Path) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    (tmp_path / "latin1.jinja").write_bytes(b"{{ 'caf\xe9' }}")  # was the codec's message, no file named
    with pytest.raises(ValueError, match=r"latin1\.jinja: not UTF-8 text \(.* at byte 8\) \(fix: re-encode"):
        resolve_chat_template(str(tmp_path / "latin1.jinja"), directory)
    (directory / "chat_template.jinja").write_bytes(b"\xff")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: not UTF-8 text"):
        resolve_chat_template("auto", directory)


def test_explicit_jinja_file_and_generation_blocks(tmp_path: Path) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    with_blocks = CHATML.replace(
        "{{ message['content'] }}<|im_end|>",
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>"
        "{% endgeneration %}{% else %}{{ message['content'] }}<|im_end|>{% endif %}",
    )
    path = tmp_path / "mine.jinja"
    path.write_text(with_blocks, encoding="utf-8")
    template = resolve_chat_template(str(path), directory)
    assert template is not None and template.source == str(path)
    hf = hf_tokenizer(directory, "chatml")
    hf.chat_template = with_blocks
    assert template.render(CHAT) == hf.apply_chat_template(CHAT, tokenize=False)
    text, spans, _ = template.supervised_spans(CHAT, "rec:1")
    assert [text[a:b] for a, b in spans] == [m["content"] + "<|im_end|>" for m in CHAT if m["role"] == "assistant"]
    assert resolve_chat_template("none", directory) is None
    (directory / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    assert resolve_chat_template("auto", directory) is None  # no template: csbp's role markers
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}), encoding="utf-8")
    from_json = resolve_chat_template("auto", directory)
    assert from_json is not None and from_json.source.endswith("chat_template.json") and from_json.text == CHATML
    for broken, kind in (([CHATML], "an array"), (CHATML, "a string")):  # used to fall back to csbp's role markers
        (directory / "chat_template.json").write_text(json.dumps(broken), encoding="utf-8")
        with pytest.raises(ValueError, match=rf"chat_template\.json: holds {kind}, not a JSON object"):
            resolve_chat_template("auto", directory)
    (directory / "chat_template.json").unlink()
    with pytest.raises(ValueError, match=r"--chat-template .*missing\.jinja: no such file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"), directory)


def test_raising_template_fails_in_one_line_naming_the_record(tmp_path: Path) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "llama3")
    data = tmp_path / "chat.jsonl"
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    data.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    config = PrepareConfig(inputs=(data,), out_dir=tmp_path / "art", seq_len=64, tokenizer_path=directory)
    with pytest.raises(ValueError) as error:
        prepare_artifact(config)
    message = str(error.value)
    assert "\n" not in message and f"{data}:2:" in message and "two user turns in a row" in message
    assert not (tmp_path / "art").exists()


def test_tojson_takes_the_options_transformers_passes(tmp_path: Path) -> None:
    source = (
        "{% for m in messages %}{{ m | tojson(ensure_ascii=False) }}{{ m | tojson(indent=2, sort_keys=True) }}"
        "{{ m | tojson(separators=(',', ':'), ensure_ascii=True) }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "caf\u00e9 <b>"}]
    rendered = ChatTemplate(source, "t").render(messages)
    assert rendered.startswith('{"role": "user", "content": "caf\u00e9 <b>"}{\n  "content"')
    assert rendered.endswith('{"role":"user","content":"caf\\u00e9 <b>"}')
    tokenizer = hf_tokenizer(build_tokenizer_dir(tmp_path / "tok", "chatml"), "chatml")
    tokenizer.chat_template = source
    assert tokenizer.apply_chat_template(messages, tokenize=False) == rendered


def test_a_template_runtime_error_is_one_line_naming_the_record() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}", "t.jinja")
    with pytest.raises(ValueError, match=r"^rec:4: chat template t\.jinja failed: TypeError: can only concatenate"):
        template.render(CHAT, where="rec:4")


def test_prefix_unstable_template_fails_naming_the_record(tmp_path: Path) -> None:
    # renders the number of messages up front: every longer prefix changes the earlier text
    template = ChatTemplate("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "t")
    with pytest.raises(ValueError, match=r"^data\.jsonl:7: chat template t is not prefix-stable"):
        template.supervised_spans(CHAT, "data.jsonl:7")


def test_content_dependent_scaffolding_fails_naming_the_record() -> None:
    source = "{% for m in messages %}<{{ m['role'] }}{% if m['content'] | length > 5 %} long{% endif %}>{{ m['content'] }}</s>{% endfor %}"
    template = ChatTemplate(source, "t")
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^data\.jsonl:3: chat template t renders the scaffolding of messages\[1\]"):
        template.supervised_spans(messages, "data.jsonl:3")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{% set x = messages.append({'role': 'user', 'content': 'x'}) %}{{ x }}",
    ],
)
def test_sandbox_refuses_escape_attempts(source: str) -> None:
    template = ChatTemplate(source, "evil.jinja")
    with pytest.raises(ValueError, match=r"^rec:1: chat template evil\.jinja (was refused by the sandbox|failed)") as info:
        template.render(CHAT, where="rec:1")
    assert ") (fix: " in str(info.value)  # was "...); (fix: ..." after a refusal


def test_syntax_error_names_the_template_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("ok\n{% for m in messages %}\n{{ m['content'] }\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.jinja: chat template line \d+:"):
        resolve_chat_template(str(path), None)


def test_cli_flag_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from csbp.cli.data_cmd import register

    def run(argv: list[str]) -> int:
        parser = argparse.ArgumentParser(prog="csbp")
        register(parser.add_subparsers(dest="command"))
        args = parser.parse_args(argv)
        return int(args.func(args))

    directory = build_tokenizer_dir(tmp_path / "tok", "llama3")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHAT[1:3]}) + "\n", encoding="utf-8")
    data.write_text(data.read_text(encoding="utf-8") * 2, encoding="utf-8")  # 64 tokens: one full row
    own = tmp_path / "own.jinja"
    own.write_text(LLAMA3.replace("<|eot_id|>", "<|eot_id|>\n"), encoding="utf-8")
    base = ["data", "prepare", str(data), "--tokenizer", str(directory), "--seq-len", "64", "--eos-token", "<|end_of_text|>"]
    assert run([*base, "--out", str(tmp_path / "a"), "--chat-template", str(own)]) == 0
    assert open_artifact(tmp_path / "a").chat_template == ChatTemplate(own.read_text(), str(own)).manifest_entry()
    capsys.readouterr()
    assert run(["data", "inspect", str(tmp_path / "a"), "--rows", "1"]) == 0
    shown = capsys.readouterr().out
    assert f"chat template {own} (sha256 " in shown
    assert "[[It is four.<|eot_id|>]]\n<|end_of_text|>" in shown  # the template's trailing newline: unsupervised
    assert "<|begin_of_text|><|start_header_id|>user" in shown


def test_bos_and_eos_named_only_in_special_tokens_map_reach_the_template(tmp_path: Path) -> None:
    """A directory whose tokenizer_config.json names no bos/eos (they are in special_tokens_map.json,
    as in older checkpoints): the template's {{ bos_token }} and {{ eos_token }} rendered as "",
    dropping the BOS and the end-of-turn token transformers' apply_chat_template writes."""
    transformers = pytest.importorskip("transformers")
    directory = build_tokenizer_dir(tmp_path / "tok", "llama3")
    template = LLAMA3.replace("<|eot_id|>", "{{ eos_token }}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}), encoding="utf-8")
    special_map = {"bos_token": {"content": "<|begin_of_text|>", "special": True}, "eos_token": "<|eot_id|>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map), encoding="utf-8")
    expected = transformers.AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(CHAT, tokenize=False)
    resolved = resolve_chat_template("auto", directory)
    assert resolved is not None and resolved.render(CHAT) == expected
    assert expected.startswith("<|begin_of_text|>") and expected.count("<|eot_id|>") == len(CHAT)
