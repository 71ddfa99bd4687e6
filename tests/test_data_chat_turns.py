"""``--chat-documents turn``: one document per assistant turn, for chat templates that rewrite
earlier turns once later ones follow (Qwen3's drops the ``<think>`` block of an assistant turn once
a user turn follows it), whose multi-turn records ``--chat-documents record`` refuses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from csbp.data import prepare as prepare_module
from csbp.data.artifact import open_artifact
from csbp.data.chat_template import ChatTemplate
from csbp.data.packing import encode_documents, turn_documents
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.data.sources import record_to_document
from csbp.data.tokenizer import CsbpTokenizer, load_tokenizer
from test_data_chat_stop import PLAIN
from test_data_chat_template import CHAT, CHATML, build_tokenizer_dir

QWEN3_LIKE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Written for these tests in the style of Qwen3's: an assistant turn after the last user turn gets an
(empty) think block, one followed by a user turn is rendered as history, plainly."""
ANSWERS = [m["content"] for m in CHAT if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("chatml"), "chatml")


@pytest.fixture(scope="module")
def tokenizer(chatml_dir: Path) -> CsbpTokenizer:
    return load_tokenizer(chatml_dir)


def supervised_runs(ids: np.ndarray, mask: np.ndarray, tokenizer: CsbpTokenizer) -> list[str]:
    runs, current = [], []
    for token, flag in zip(ids.tolist(), mask.tolist()):
        if flag:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def encode_turns(messages: list[dict[str, str]], template: str, tokenizer: CsbpTokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    documents = turn_documents(record_to_document({"messages": messages}, "chat.jsonl:1"))
    return encode_documents(documents, tokenizer, ChatTemplate(template, "t.jinja"))


def test_record_documents_refuse_a_qwen3_like_template_naming_the_option(tokenizer: CsbpTokenizer) -> None:
    template = ChatTemplate(QWEN3_LIKE, "t.jinja")
    # the first assistant turn loses its think block once the next user turn follows
    assert "<think>\n\n</think>\n\nIt is four." in template.render(CHAT[:3])
    assert "<think>" not in template.render(CHAT[:4])
    document = record_to_document({"messages": CHAT}, "chat.jsonl:1")
    with pytest.raises(ValueError, match=r"^chat\.jsonl:1: chat template t\.jinja is not prefix-stable .*\(fix: --chat-documents turn"):
        encode_documents([document], tokenizer, template)


def test_turn_documents_supervise_each_assistant_turn_once(tokenizer: CsbpTokenizer) -> None:
    encoded = encode_turns(CHAT, QWEN3_LIKE, tokenizer)
    assert len(encoded) == 2
    template = ChatTemplate(QWEN3_LIKE, "t.jinja")
    turns = [index for index, m in enumerate(CHAT) if m["role"] == "assistant"]
    for (ids, mask), index, answer in zip(encoded, turns, ANSWERS):
        # the conversation up to the turn as the template renders it then (earlier turns as history)
        assert ids[:-1].tolist() == tokenizer.encode(template.render(CHAT[: index + 1]))
        assert supervised_runs(ids, mask, tokenizer) == [answer + "<|im_end|>"]
        assert ids[-1] == tokenizer.eos_id and mask[-1] == 0  # the template's <|im_end|> is the stop
    later = tokenizer.decode(encoded[1][0].tolist())
    assert "assistant\nIt is four.<|im_end|>" in later and "<think>\n\n</think>\n\nBlue, like the sky." in later


def test_a_prefix_stable_template_supervises_the_same_tokens_either_way(tokenizer: CsbpTokenizer) -> None:
    record = record_to_document({"messages": CHAT}, "chat.jsonl:1")
    [(whole_ids, whole_mask)] = encode_documents([record], tokenizer, ChatTemplate(CHATML, "t.jinja"))
    whole_runs = supervised_runs(whole_ids, whole_mask, tokenizer)
    assert whole_runs == [answer + "<|im_end|>" for answer in ANSWERS]
    for turn, (ids, mask) in enumerate(encode_turns(CHAT, CHATML, tokenizer)):
        length = ids.shape[0] - 1  # each turn document is the record's tokens up to its turn, then EOS
        assert ids[:-1].tolist() == whole_ids[:length].tolist()
        assert supervised_runs(ids, mask, tokenizer) == [whole_runs[turn]]
        # the supervised positions are the record's last supervised run within that prefix
        assert np.array_equal(np.flatnonzero(mask[:-1]), np.flatnonzero(whole_mask[:length])[-int(mask.sum()) :])


def test_without_end_of_turn_text_every_turn_gets_its_eos_as_the_stop(tokenizer: CsbpTokenizer) -> None:
    for ids, mask in encode_turns(CHAT, PLAIN, tokenizer):
        assert (tokenizer.decode([int(ids[-1])]), int(mask[-1])) == ("<|endoftext|>", 1)


def test_records_without_an_assistant_turn_and_trailing_turns(tokenizer: CsbpTokenizer) -> None:
    trailing = [*CHAT[1:3], {"role": "user", "content": "Thanks."}]
    [document] = turn_documents(record_to_document({"messages": trailing}, "r:1"))
    assert document.messages == (("user", CHAT[1]["content"]), ("assistant", CHAT[2]["content"]))
    # no assistant turn: the record as it is, nothing supervised, no prefix requirement
    [(ids, mask)] = encode_turns(CHAT[:2], QWEN3_LIKE, tokenizer)
    assert ids[:-1].tolist() == tokenizer.encode(ChatTemplate(QWEN3_LIKE, "t").render(CHAT[:2])) and not mask.any()
    text = record_to_document({"text": "Blue."}, "r:2")
    assert turn_documents(text) == [text]


def test_a_template_rewriting_the_turns_before_the_last_fails_naming_the_record() -> None:
    template = ChatTemplate("{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "t")
    with pytest.raises(ValueError, match=r"^data\.jsonl:7: chat template t renders messages\[:2\] differently .*even --chat-documents turn"):
        template.last_turn_spans(CHAT[:3], "data.jsonl:7")


def run_cli(argv: list[str]) -> int:
    from csbp.cli.data_cmd import register

    parser = argparse.ArgumentParser(prog="csbp")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_prepare_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    (directory / "chat_template.jinja").write_text(QWEN3_LIKE, encoding="utf-8")
    data = tmp_path / "chat.jsonl"
    records = [{"messages": CHAT}, {"messages": CHAT[1:3]}, {"text": "Blue."}]
    data.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    base = ["data", "prepare", str(data), "--tokenizer", str(directory), "--seq-len", "16"]
    with pytest.raises(ValueError, match=rf"^{data}:1: chat template .* not prefix-stable .*--chat-documents turn"):
        run_cli([*base, "--out", str(tmp_path / "refused")])
    assert not (tmp_path / "refused").exists()
    capsys.readouterr()
    assert run_cli([*base, "--out", str(tmp_path / "a"), "--chat-documents", "turn"]) == 0
    said = capsys.readouterr().out
    assert "--chat-documents turn: 2 chat records became 3 documents of " in said and "x the " in said
    # the count before it is of records (it said "3 documents", then "became 3 documents" of 2 of them)
    assert "\n3 records (0 val), 0 empty skipped\n" in said
    artifact = open_artifact(tmp_path / "a", verify=True)
    assert artifact.manifest["options"]["chat_documents"] == "turn"
    assert artifact.manifest["counts"]["documents"] == 3  # the records read
    assert artifact.manifest["splits"]["train"]["documents"] == 4  # what was packed: 2 + 1 turns, the text
    assert run_cli(["data", "inspect", str(tmp_path / "a"), "--rows", "0"]) == 0
    shown = capsys.readouterr().out
    assert "chat docs     one per assistant turn, only it supervised (--chat-documents turn)" in shown
    tokens = artifact.manifest["counts"]["tokens"]
    assert f"documents     3 records (0 empty skipped), {tokens} tokens; 4 documents packed\n" in shown


def test_the_documents_of_a_record_stay_in_its_split(tmp_path: Path, chatml_dir: Path) -> None:
    data = tmp_path / "chat.jsonl"
    turns = [CHAT[1:3], CHAT[1:3] + CHAT[3:5], CHAT[1:3] + CHAT[3:5] + CHAT[1:3]]  # 1, 2, 3 assistant turns
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in turns), encoding="utf-8")
    (template := tmp_path / "q.jinja").write_text(QWEN3_LIKE, encoding="utf-8")
    config = PrepareConfig(
        inputs=(data,), out_dir=tmp_path / "art", seq_len=8, tokenizer_path=chatml_dir, val_fraction=0.3,
        chat_template=str(template), chat_documents="turn",
    )
    splits = prepare_artifact(config)["splits"]
    [val_record] = prepare_module._choose_val_documents(3, 0.3, 0)  # records are split, then turned into documents
    assert splits["val"]["documents"] == val_record + 1 and splits["train"]["documents"] == 6 - (val_record + 1)


def test_turn_documents_need_a_chat_template(tmp_path: Path, chatml_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"text": "Blue."}) + "\n" + json.dumps({"messages": CHAT}) + "\n", encoding="utf-8")
    options = {"inputs": (data,), "out_dir": tmp_path / "art", "seq_len": 8, "chat_documents": "turn"}
    with pytest.raises(ValueError, match=r"^--chat-documents turn renders each assistant turn .*\(fix: --chat-template PATH"):
        PrepareConfig(**options, tokenizer_path=chatml_dir, chat_template="none")
    with pytest.raises(ValueError, match=r"chat_documents is 'each'; use 'record' or 'turn'"):
        PrepareConfig(**{**options, "chat_documents": "each"}, tokenizer_path=chatml_dir)  # type: ignore[arg-type]
    monkeypatch.setattr(prepare_module, "encode_documents", lambda *a, **k: pytest.fail("encoded"))
    with pytest.raises(ValueError, match=rf"^{data}:2: --chat-documents turn renders each assistant turn"):
        prepare_artifact(PrepareConfig(**options, train_tokenizer=True, vocab_size=300))  # no template: role markers
    monkeypatch.setattr(prepare_module, "MAX_DOCUMENTS_PER_SPLIT", 2)
    with pytest.raises(ValueError, match=r"^--chat-documents turn: the train split would hold up to 3 documents"):
        prepare_artifact(PrepareConfig(**options, tokenizer_path=chatml_dir))
