"""Conversation formats of the multimodal LLMs: an instruction sample's turns -> token ids and loss mask.

* ``vicuna_v1``: LLaVA-1.5's conversation, the one it was trained with and CoIN / MCITlib evaluate with
  (haotian-liu/LLaVA ``llava/conversation.py`` ``conv_vicuna_v1`` = ``conv_templates['v1']``, which LLaVA-1.5's
  fine-tuning used; ``SeparatorStyle.TWO``): its system prompt ("a curious user"; the "curious human" one is
  ``conv_llava_v1``'s, another template), then ``USER: <question> ASSISTANT: <answer></s>`` per turn (" " after
  a user turn, the EOS string after an assistant turn); with an image, ``<image>\\n`` opens the first question (LLaVA's
  ``preprocess_multimodal`` moves it there); a prompt to generate from ends in ``ASSISTANT:``. Tokenised
  as LLaVA's ``tokenizer_image_token``: the text before and after the image placeholder each tokenised
  on its own (each with BOS, kept only for the first piece) around one image token.
* ``processor``: the checkpoint's own chat template (llava-hf, Qwen2-VL), the whole text tokenised at
  once, as the checkpoint's processor does; the answer is what the template puts between the generation
  prompt and the end-of-turn token (Qwen's turns have no leading space, llava-hf's do). A checkpoint
  without a chat template (InstructBLIP) is prompted with the instruction itself, and answers are
  tokenised separately and appended with EOS, as LAVIS' ``blip2_vicuna_instruct`` does.

The loss mask is found from character offsets in the rendered text: every token that starts inside an
answer or its end-of-turn token is trained on, and nothing else; no token-count arithmetic (the source
of LLaVA's "tokenization mismatch" warnings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHAT_FORMATS = ("processor", "vicuna_v1")
VICUNA_V1_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                    "The assistant gives helpful, detailed, and polite answers to the user's questions.")
IMAGE = "<image>"  # the placeholder in stored questions and in LLaVA's conversation


@dataclass
class Rendered:
    """A conversation as text pieces. ``whole``: the pieces are joined and tokenised at once (split at the
    image placeholder when ``image_chunks``); otherwise each piece is tokenised on its own."""

    pieces: list[tuple[str, bool]] = field(default_factory=list)  # (text, trained on)
    whole: bool = True
    image_chunks: bool = False

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.pieces)


def first_question(question: str, has_image: bool, image: str) -> str:
    """The first user turn as LLaVA stores it: the placeholder moved to the front (``image`` + newline)."""
    if not has_image:
        return question.replace(IMAGE, "").strip() if IMAGE in question else question
    return f"{image}\n{question.replace(IMAGE, '').strip()}"


def render_vicuna_v1(turns: list[tuple[str, str]], *, train: bool, has_image: bool, eos: str) -> Rendered:
    """LLaVA's conv_vicuna_v1 prompt; ``train=False`` leaves the last answer out (``... ASSISTANT:``)."""
    r = Rendered(image_chunks=True)
    text = VICUNA_V1_SYSTEM + " "
    for i, (q, a) in enumerate(turns):
        q = first_question(q, has_image, IMAGE) if i == 0 else q
        text += f"USER: {q} ASSISTANT:"
        if i == len(turns) - 1 and not train:
            break
        r.pieces.append((text, False))
        r.pieces.append((f" {a}{eos}", True))
        text = ""
    if text:
        r.pieces.append((text, False))
    return r


def messages(turns: list[tuple[str, str]], upto: int, has_image: bool, with_answer: bool) -> list[dict]:
    msgs: list[dict] = []
    for i, (q, a) in enumerate(turns[: upto + 1]):
        content: list[dict] = [{"type": "text", "text": q.replace(IMAGE, "").strip()}]
        if i == 0 and has_image:
            content.insert(0, {"type": "image"})
        msgs.append({"role": "user", "content": content})
        if i < upto or with_answer:
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
    return msgs


def render_template(processor: Any, turns: list[tuple[str, str]], *, train: bool, has_image: bool,
                    end_tokens: list[str]) -> Rendered:
    """The checkpoint's chat template. Each answer's span is found between the generation prompt and the
    end-of-turn token the template writes after it (the first of ``end_tokens`` that follows)."""

    def render(msgs: list[dict], gen: bool) -> str:
        return processor.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

    r = Rendered()
    done = 0
    last = len(turns) - 1
    for i, (_, a) in enumerate(turns):
        prompt = render(messages(turns, i, has_image, False), True)
        if not prompt.startswith(r.text):
            raise ValueError("the chat template does not render a conversation's turns as prefixes of each other")
        if i == last and not train:
            r.pieces.append((prompt[done:], False))
            return r
        full = render(messages(turns, i, has_image, True), False)
        if not full.startswith(prompt):
            raise ValueError("the chat template's generation prompt is not a prefix of its assistant turn")
        tail = full[len(prompt):]
        at = tail.find(a)
        if at < 0 or tail[:at].strip():
            raise ValueError(f"the chat template does not write the answer {a!r} right after the generation prompt")
        end = at + len(a)
        for tok in end_tokens:
            if tail[end:].lstrip(" ").startswith(tok):
                end += tail[end:].index(tok) + len(tok)
                break
        r.pieces.append((prompt[done:], False))
        r.pieces.append((tail[:end], True))
        done = len(prompt) + end
        if i == last:
            r.pieces.append((full[done:], False))
    return r


def render_plain(turns: list[tuple[str, str]], *, train: bool, eos: str) -> Rendered:
    """No chat template (InstructBLIP): the instruction, then the answer + EOS tokenised apart (LAVIS)."""
    r = Rendered(whole=False)
    for i, (q, a) in enumerate(turns):
        r.pieces.append((q.replace(IMAGE, "").strip() if i == 0 else q, False))
        if i == len(turns) - 1 and not train:
            break
        r.pieces.append((a + eos, True))
    return r


def tokenize(tokenizer: Any, r: Rendered, image_token_id: int) -> tuple[list[int], list[bool]]:
    """(token ids, trained-on flags) of a rendering; an image placeholder becomes one ``image_token_id``
    (the caller expands it to the image's token count)."""
    if not r.whole:
        ids: list[int] = []
        flags: list[bool] = []
        for k, (text, target) in enumerate(r.pieces):
            piece = tokenizer(text, add_special_tokens=k == 0)["input_ids"]
            ids += piece
            flags += [target] * len(piece)
        return ids, flags
    spans, pos = [], 0
    for text, target in r.pieces:
        if target:
            spans.append((pos, pos + len(text)))
        pos += len(text)
    text = r.text
    chunks = text.split(IMAGE) if r.image_chunks else [text]
    ids, starts = [], []
    bos = tokenizer.bos_token_id
    base = 0
    keep_first = True
    for k, chunk in enumerate(chunks):
        enc = tokenizer(chunk, add_special_tokens=True, return_offsets_mapping=True)
        cid, off = list(enc["input_ids"]), list(enc["offset_mapping"])
        if k == 0:
            keep_first = not (cid and cid[0] == bos)  # tokenizer_image_token: offset 1 when BOS leads
            if not keep_first:
                ids.append(cid[0])
                starts.append(-1)
        else:
            ids.append(image_token_id)
            starts.append(-1)
        if not keep_first:
            cid, off = cid[1:], off[1:]
        ids += cid
        starts += [base + s if e > s else -1 for s, e in off]  # special tokens added by the tokenizer: no span
        base += len(chunk) + len(IMAGE)
    flags = [s >= 0 and any(a <= s < b for a, b in spans) for s in starts]
    return ids, flags
