"""An assistant turn's reasoning in a chat rendered by its template (thinking models: Qwen3, R1 distills).

A reasoning trace reaches the template as the message's ``reasoning_content``, or inline as
``<think>R</think>C`` in its content. ``ChatTemplate`` locates the reasoning the template renders
for the supervised turn with a sentinel, as it locates the content; this module holds the rules
around that:

* what is supervised: a turn with reasoning is supervised from the end of its generation prompt
  (``messages[:i]`` rendered with ``add_generation_prompt``) through its end-of-turn text, since the
  model writes all of it at inference (Qwen3: ``<think>\\n`` R ``\\n</think>\\n\\n`` C ``<|im_end|>``;
  the role header is the prompt's). :func:`generation_end` finds that point, and refuses a turn that
  does not continue its generation prompt;
* inline reasoning (:func:`split_inline_reasoning`) is moved into ``reasoning_content`` only where
  the template renders the split message to the very same text (it splits the content itself, as
  Qwen3's does), so the training text is always the template's render of the record as given; a
  template that keeps ``<think>`` in the content (ChatML) trains it as content, and one that drops it
  (R1's) is refused (:func:`refusal`);
* reasoning or content the template renders other than as given (whitespace at the ends aside:
  :func:`as_given`), or not at all, is refused rather than trained without its reasoning;
* :func:`dropped_reasoning` names the earlier turn whose reasoning a template drops once a later
  turn follows (Qwen3's history form), for the refusal that names ``--chat-documents turn``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from csbp.data.chat_template import ChatTemplate, Message

REASONING = "reasoning_content"
THINK_START, THINK_END = "<think>", "</think>"


def as_given(rendered: str, given: str) -> bool:
    """The template rendered ``given`` unchanged but for leading and trailing whitespace (Qwen3
    strips the newlines around the reasoning and before the content)."""
    return rendered.strip() == given.strip()


def inline_reasoning(content: str) -> str:
    """The reasoning of a content holding one ``</think>``: the text before it, after any ``<think>``
    ("" when the content holds no ``</think>`` or several)."""
    if content.count(THINK_END) != 1:
        return ""
    return content.partition(THINK_END)[0].split(THINK_START)[-1]


def split_inline_reasoning(template: ChatTemplate, messages: Sequence[Message], index: int, text: str,
                           where: str) -> Sequence[Message] | None:
    """``messages[:index+1]`` with message ``index``'s content ``<think>R</think>C`` (one of each tag at
    most) as ``reasoning_content`` R and content C, when ``template`` renders that to ``text``, the
    render of the messages as given; else None."""
    message = messages[index]
    content = message["content"]
    if REASONING in message or content.count(THINK_END) != 1 or content.count(THINK_START) > 1:
        return None
    split = [*messages[:index], {**message, "content": content.partition(THINK_END)[2],
                                 REASONING: inline_reasoning(content)}]
    return split if template.render(split, where=where) == text else None


def generation_end(template: ChatTemplate, messages: Sequence[Message], index: int, rendered: str, text: str,
                   first: int, where: str) -> int:
    """Where the model starts writing message ``index`` (an assistant turn with reasoning) in ``text``:
    the end of its generation prompt, ``messages[:index]`` rendered with ``add_generation_prompt``, which
    must add text to ``rendered`` (their render without it), begin ``text`` and end by ``first`` (where
    the reasoning or the content starts)."""
    prompt = template.render(messages[:index], add_generation_prompt=True, where=where)
    if len(rendered) < len(prompt) <= first and prompt.startswith(rendered) and text.startswith(prompt):
        return len(prompt)
    raise ValueError(
        f"{where}: chat template {template.source} renders messages[{index}] with its reasoning as text that does "
        f"not continue its generation prompt (messages[:{index}] rendered with add_generation_prompt), so what the "
        "model writes after the prompt cannot be found (fix: a template whose generation prompt opens the "
        "assistant turn, as Qwen3's does; or remove the reasoning)"
    )


def refusal(template: ChatTemplate, where: str, index: int, field: str, inline: bool) -> str:
    """The one line refusing message ``index``, whose ``field`` the template does not render exactly
    once as given next to its reasoning (``inline``: the reasoning is ``<think>...</think>`` in the
    content)."""
    if inline:
        return (
            f"{where}: chat template {template.source} does not render messages[{index}].content, which holds "
            f"{THINK_END}, as given: it drops or moves the reasoning before {THINK_END}, so the turn would be "
            f"trained without it (fix: put the reasoning in messages[{index}].reasoning_content, without the think "
            "tags, and the answer alone in content; or a template that renders reasoning_content, such as Qwen3's)"
        )
    return (
        f"{where}: chat template {template.source} does not render messages[{index}].{field} exactly once as given "
        "in a turn with reasoning, so the turn would be trained without the reasoning it was written with (fix: a "
        "template that renders reasoning_content, such as Qwen3's; or remove the field)"
    )


def dropped_reasoning(messages: Sequence[Message], index: int, before: str, after: str) -> int | None:
    """The first assistant message before ``index`` whose reasoning is in ``before`` (the render of
    the messages before ``index``) and gone from ``after`` (the render once message ``index`` follows)."""
    for earlier, message in enumerate(messages[:index]):
        thought = (message.get(REASONING) or inline_reasoning(message["content"])).strip()
        if thought and thought in before and thought not in after:
            return earlier
    return None
