"""Conversation formats (mcit.models.chat): LLaVA-1.5's vicuna_v1 rendered and tokenised as LLaVA's own
code does, the loss on the answers and their end-of-turn tokens only; Qwen-style templates without a
leading space; text-only and multi-turn samples."""

from __future__ import annotations

import io
import json

import pytest
import torch

SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")
IGNORE = -100


def llama_like_tokenizer():
    """A tokenizer that splits words as Llama's sentencepiece model does (a "▁" before each word, a
    dummy prefix on the first piece only, i.e. ``legacy: false``; a trailing space becomes its own "▁"),
    BOS added, ``</s>`` and ``<image>`` special."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [SYSTEM, "USER: ASSISTANT: what is in the image? a red square. how many dots? three",
              "\nwhat colour is the shape? answer with one word. blue green yellow 12 one two the left right",
              "-USER -ASSISTANT"] * 5
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([  # words as Llama's pieces: "▁USER" and ":" apart, "USER" known
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
        pre_tokenizers.Punctuation()])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})


@pytest.fixture(scope="module")
def vicuna_llava():
    from mcit.models.mllm import MLLMBackbone
    from mcit.models.tiny_llava import CHAT_TEMPLATE, build_model, build_processor

    tok = llama_like_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = build_model(tok, image_size=16, patch_size=8, vision_hidden=32, vision_layers=1, text_hidden=32,
                        text_layers=1)
    return MLLMBackbone.wrap(model, build_processor(tok, image_size=16, patch_size=8), chat_format="vicuna_v1")


def llava_tokenizer_image_token(prompt: str, tokenizer, image_index: int) -> list[int]:
    """haotian-liu/LLaVA llava/mm_utils.py tokenizer_image_token, as published."""
    chunks = [tokenizer(c).input_ids for c in prompt.split("<image>")]
    out, offset = [], 0
    if chunks and chunks[0] and chunks[0][0] == tokenizer.bos_token_id:
        offset = 1
        out.append(chunks[0][0])
    sep = [image_index] * (offset + 1)
    for x in [e for sub in zip(chunks, [sep] * len(chunks)) for e in sub][:-1]:
        out.extend(x[offset:])
    return out


def llava_prompt(turns: list[tuple[str, str]], *, answer_last: bool) -> str:
    """LLaVA's conv_vicuna_v1.get_prompt() (SeparatorStyle.TWO, seps " " and "</s>"), the image moved to the
    front of the first question as preprocess_multimodal / model_vqa do; the last answer None -> "ASSISTANT:"."""
    seps = [" ", "</s>"]
    messages = []
    for i, (q, a) in enumerate(turns):
        last = i == len(turns) - 1
        messages += [("USER", ("<image>\n" + q.replace("<image>", "").strip()) if i == 0 else q),
                     ("ASSISTANT", a if answer_last or not last else None)]
    ret = SYSTEM + seps[0]
    for i, (role, message) in enumerate(messages):
        ret += (role + ": " + message + seps[i % 2]) if message else (role + ":")
    return ret


def answer_mask(ids: list[int], tokenizer) -> list[int]:
    """The labels LLaVA trains on, found by content: after each "ASSISTANT:" the tokens up to and including
    the next </s>. (LLaVA's preprocess_v1 finds them by token-count arithmetic that holds only for some
    tokenizer versions -- its "tokenization mismatch" warnings; the spans it means are these.)"""
    marker = tokenizer(" ASSISTANT:", add_special_tokens=False)["input_ids"][-2:]
    labels = [IGNORE] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i: i + len(marker)] == marker:
            j = i + len(marker)
            while ids[j] != tokenizer.eos_token_id:
                labels[j] = ids[j]
                j += 1
            labels[j] = ids[j]
            i = j
        i += 1
    return labels


def expand(ids: list[int], labels: list[int], image_index: int, n: int) -> tuple[list[int], list[int]]:
    out_i, out_l = [], []
    for t, lab in zip(ids, labels):
        out_i += [t] * (n if t == image_index else 1)
        out_l += [lab] * (n if t == image_index else 1)
    return out_i, out_l


def sample(key: str, conversations: list[dict], image: bool = True) -> dict:
    from PIL import Image

    s = {"__key__": key,
         "json": json.dumps({"conversations": conversations, **({} if image else {"text_only": True})}).encode()}
    if image:
        buf = io.BytesIO()
        Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="PNG")
        s["png"] = buf.getvalue()
    return s


def conv(*pairs: tuple[str, str]) -> list[dict]:
    return [m for q, a in pairs for m in ({"from": "human", "value": q}, {"from": "gpt", "value": a})]


def test_vicuna_v1_training_sample_and_prompt_are_llavas_own(vicuna_llava):
    """LLaVA-1.5's vicuna_v1: the token ids of a two-turn training sample and of an evaluation prompt are
    those LLaVA's conversation template and tokenizer_image_token produce, and the loss covers exactly
    each answer and its </s>."""
    bb = vicuna_llava
    tok = bb.tokenizer
    img = bb.image_token_id
    n_img = bb.model.config.image_seq_length
    pairs = [("<image>\nwhat colour is the shape?\nanswer with one word.", "blue"), ("how many dots?", "three")]
    rendered = bb.render(pairs, train=True, has_image=True).text
    assert rendered == (SYSTEM + " USER: <image>\nwhat colour is the shape?\nanswer with one word. ASSISTANT: blue</s>"
                        "USER: how many dots? ASSISTANT: three</s>")
    batch = bb.make_collate(None, 0, train=True)([sample("a", conv(*pairs))])
    llava_ids = llava_tokenizer_image_token(llava_prompt(pairs, answer_last=True), tok, img)
    want_ids, want_lab = expand(llava_ids, answer_mask(llava_ids, tok), img, n_img)
    assert batch.inputs["input_ids"][0].tolist() == want_ids
    assert batch.labels[0].tolist() == want_lab
    trained = [t for t in batch.labels[0].tolist() if t != IGNORE]
    assert trained == (tok("blue", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                       + tok("three", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    assert tok.decode(trained) .replace(" ", "") == "blue</s>three</s>"
    # evaluation: the prompt ends in "ASSISTANT:", history included, left-padded
    ev = bb.make_collate(None, 0, train=False)([sample("b", conv(pairs[0])), sample("c", conv(*pairs))])
    for row, upto in ((0, 1), (1, 2)):
        prompt = llava_prompt(pairs[:upto], answer_last=False)
        assert prompt.endswith("ASSISTANT:")
        want, _ = expand(llava_tokenizer_image_token(prompt, tok, img), [0] * 10**4, img, n_img)
        n = int(ev.inputs["attention_mask"][row].sum())
        assert ev.inputs["input_ids"][row, -n:].tolist() == want
        assert (ev.labels[row] == IGNORE).all()
    assert ev.meta[1]["question"] == "how many dots?" and ev.meta[1]["answer"] == "three"


def test_text_only_samples_have_no_image_tokens_and_mix_with_image_samples(vicuna_llava):
    """A text-only sample is rendered as LLaVA renders one (no <image>, the question as it is) and trains in
    a batch beside an image sample; the image's features go to that sample's image tokens only."""
    bb = vicuna_llava
    tok = bb.tokenizer
    batch = bb.make_collate(None, 0, train=True)([sample("t", conv(("what is the left colour?", "green")), image=False),
                                                 sample("i", conv(("<image>\nwhat is in the image?", "a red square")))])
    ids = batch.inputs["input_ids"][0][batch.inputs["attention_mask"][0].bool()].tolist()
    assert ids == tok(SYSTEM + " USER: what is the left colour? ASSISTANT: green</s>")["input_ids"]
    assert bb.image_token_id not in ids
    assert batch.inputs["has_image"].tolist() == [False, True]
    assert int((batch.inputs["input_ids"][1] == bb.image_token_id).sum()) == bb.model.config.image_seq_length
    embeds, pooled = bb.input_embeddings(batch)
    plain = bb.model.get_input_embeddings()(batch.inputs["input_ids"][:1])
    assert torch.equal(embeds[:1], plain)  # nothing scattered into the text-only row
    assert pooled.shape[0] == 2
    assert torch.isfinite(bb.lm_loss(embeds, batch.inputs["attention_mask"], batch.labels)).all()


QWEN2_VL_TEMPLATE = (  # Qwen/Qwen2-VL-7B-Instruct chat_template.json (images only)
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_qwen_template_answer_has_no_leading_space(tmp_path):
    """A Qwen2-VL turn is ``<|im_start|>assistant\\n<answer><|im_end|>``: with a byte-level tokenizer (where
    " blue" and "blue" differ) the target is the answer's own tokens and <|im_end|>, and every sample is
    what Qwen's processor makes of its own template (two turns: the history in the prompt)."""
    from PIL import Image
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from mcit.models.base import load_backbone
    from mcit.models.tiny_llava import build_qwen2_vl

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                "<|video_pad|>"]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(["system You are a helpful assistant. user assistant what colour is the shape? blue "
                             "how many dots? three"] * 5,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  unk_token="<|video_pad|>", bos_token="<|vision_start|>",
                                  extra_special_tokens={"image_token": "<|image_pad|>"})
    assert tok(" blue", add_special_tokens=False)["input_ids"] != tok("blue", add_special_tokens=False)["input_ids"]
    model, proc = build_qwen2_vl(tok, image_token="<|image_pad|>", vision_start="<|vision_start|>",
                                 chat_template=QWEN2_VL_TEMPLATE)
    model.save_pretrained(tmp_path / "qwen")
    proc.save_pretrained(tmp_path / "qwen")
    bb = load_backbone("qwen2_vl", str(tmp_path / "qwen"))
    tok = bb.tokenizer
    pairs = [("<image>\nwhat colour is the shape?", "blue"), ("how many dots?", "three")]
    batch = bb.make_collate(None, 0, train=True)([sample("q", conv(*pairs))])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    trained = batch.labels[0][batch.labels[0] != IGNORE].tolist()
    assert trained == (tok("blue", add_special_tokens=False)["input_ids"] + [end]
                       + tok("three", add_special_tokens=False)["input_ids"] + [end])
    image = Image.new("RGB", (16, 16), (200, 30, 30))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the shape?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "blue"}]},
            {"role": "user", "content": [{"type": "text", "text": "how many dots?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "three"}]}]
    own = bb.processor(text=[bb.processor.apply_chat_template(msgs)], images=[image])["input_ids"][0].tolist()
    assert batch.inputs["input_ids"][0].tolist() == own
    ev = bb.make_collate(None, 0, train=False)([sample("q", conv(*pairs))])
    own = bb.processor(text=[bb.processor.apply_chat_template(msgs[:3], add_generation_prompt=True)],
                       images=[image])["input_ids"][0].tolist()
    assert ev.inputs["input_ids"][0].tolist() == own
    assert bb.positions(batch).shape[1:] == batch.inputs["input_ids"].shape


def test_llava_15_tags_default_to_vicuna_v1(mcit_assets):
    from mcit.core.config import BackboneConfig

    def fmt(tag: str, **kw: str) -> str:
        return BackboneConfig(kind="llava", path=str(mcit_assets["backbone"]), tag=tag, **kw).chat_format

    assert fmt("llava_v1.5_7b") == fmt("llava-1.5-7b") == fmt("LLaVA-v1.5-13b") == "vicuna_v1"
    assert fmt("local") == fmt("qwen2-vl-7b") == fmt("llava-1.6") == "processor"
    assert fmt("llava-1.5-7b", chat_format="processor") == "processor"


def lavis_instruct_tokens(tokenizer, instruction: str, answer: str) -> tuple[list[int], list[int]]:
    """salesforce/LAVIS blip2_vicuna_instruct.forward as published: the instruction tokenised with BOS, the answer
    + EOS tokenised apart with its BOS dropped (``concat_text_input_output``: ``output_ids[i][1:]``), targets -100
    on the instruction (the query tokens go in front of both as embeddings, also -100)."""
    inp = tokenizer(instruction).input_ids
    out = tokenizer(answer + tokenizer.eos_token).input_ids[1:]
    return inp + out, [IGNORE] * len(inp) + out


def test_instructblip_sample_is_lavis_own(mcit_assets):
    """InstructBLIP has no chat template: a training sample is LAVIS' (instruction, then answer + EOS), behind the
    Q-Former's query tokens; an evaluation prompt is the instruction alone."""
    from PIL import Image

    from mcit.data import tiny_mcit as B
    from mcit.models.instructblip import InstructBlipBackbone

    model, proc = InstructBlipBackbone.tiny(B.corpus())
    bb = InstructBlipBackbone(model, proc)
    q, a = "<image>\nwhat colour is the shape?", "blue"
    ids, labels, _ = bb.encode([(q, a)], Image.new("RGB", (16, 16), (200, 30, 30)), train=True)
    n = model.config.num_query_tokens
    want_ids, want_labels = lavis_instruct_tokens(bb.tokenizer, "what colour is the shape?", a)
    assert ids == [bb.image_token_id] * n + want_ids and labels == [IGNORE] * n + want_labels
    assert [t for t in labels if t != IGNORE] == bb.tokenizer(" blue</s>", add_special_tokens=False).input_ids
    ids, labels, _ = bb.encode([(q, a)], Image.new("RGB", (16, 16), (200, 30, 30)), train=False)
    assert ids == [bb.image_token_id] * n + bb.tokenizer("what colour is the shape?").input_ids
