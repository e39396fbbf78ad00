"""LLaVA-1.5 and Vicuna directories as they are published: a SentencePiece ``tokenizer.model``, no ``tokenizer.json``
(liuhaotian/llava-v1.5-7b, lmsys/vicuna-7b-v1.5). The tiny fixture of llava_original.py in both original layouts with
such a tokenizer (trained offline by sentencepiece's own trainer) converts with ``python -m data_prep.convert_llava``
(exit 0; it used to stop on a tiktoken ValueError without sentencepiece and protobuf), and the converted
processor's ids of the vicuna_v1 prompt are LLaVA's: ``tokenizer_image_token`` over the slow ``LlamaTokenizer``
(``legacy: false``) that LLaVA loads (``use_fast=False``, transformers 4.37), re-derived here from the SentencePiece
model by that tokenizer's own rule. The converted model's logits through mcit's wrapper equal transformers' forward,
and the two layouts convert to the same weights. (The official code's logits were computed on the tokenizers.json
fixture: test_llava_conversion_reference.py; these weights differ by their 300-piece vocabulary.)"""

from __future__ import annotations

import pytest
import tiny_inputs as T
import torch
from safetensors.torch import load_file

IMAGE_TOKEN_INDEX = -200  # llava/constants.py


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    import llava_original as L

    from data_prep.convert_llava import main

    base = tmp_path_factory.mktemp("llava_sentencepiece")
    paths = L.build(base / "src", sentencepiece=True)
    assert not (paths["llava"] / "tokenizer.json").exists() and (paths["llava"] / "tokenizer.model").is_file()
    out = {"llava": base / "hf", "vicuna": base / "hf_vicuna"}
    args = {"llava": ["--llava", str(paths["llava"])],
            "vicuna": ["--vicuna", str(paths["vicuna"]), "--mm-projector", str(paths["mm_projector"])]}
    for layout, d in out.items():
        assert main([*args[layout], "--clip", str(paths["clip"]), "--out", str(d), "--no-progress"]) == 0, layout
    return paths, out


def slow_llama_ids(model: bytes, text: str) -> list[int]:
    """transformers 4.37's ``LlamaTokenizer`` (the slow one LLaVA loads), ``legacy=False``, without BOS: the
    SentencePiece model with its dummy prefix turned off (``get_spm_processor``), the text prefixed with "▁"
    (``tokenize``) and encoded after ``unk_token`` whose pieces are then cut off (``_tokenize``)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    proto.normalizer_spec.add_dummy_prefix = False
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    text = "▁" + text.replace("▁", " ")
    unk = len(sp.encode("<unk>", out_type=str))
    pieces = sp.encode("<unk>" + text, out_type=str)[unk:]
    if len(pieces) > 1 and pieces[0] == "▁" and pieces[1] in ("<s>", "</s>", "<unk>"):
        pieces = pieces[1:]
    return [sp.piece_to_id(p) for p in pieces]


def tokenizer_image_token(model: bytes, prompt: str) -> list[int]:
    """llava/mm_utils.py ``tokenizer_image_token``: each chunk between ``<image>``s tokenised with BOS, the
    first chunk's BOS kept once, ``IMAGE_TOKEN_INDEX`` between the chunks."""
    chunks = [[1, *slow_llama_ids(model, c)] for c in prompt.split("<image>")]
    ids = [1]
    for k, chunk in enumerate(chunks):
        ids += ([IMAGE_TOKEN_INDEX] if k else []) + chunk[1:]
    return ids


@pytest.mark.parametrize("layout", ["llava", "vicuna"])
@torch.no_grad()
def test_a_sentencepiece_checkpoint_converts_and_tokenises_as_llava(converted, layout):
    import llava_original as L

    from mcit.models.base import load_backbone

    paths, out = converted
    bb = load_backbone("llava", str(out[layout]), chat_format="vicuna_v1")
    batch = bb.make_collate(None, 0, train=False)([L.sample(L.image())])
    want = tokenizer_image_token((paths[layout] / "tokenizer.model").read_bytes(), L.PROMPT)
    assert want.count(IMAGE_TOKEN_INDEX) == 1 and len(want) > 30
    at, n_image = want.index(IMAGE_TOKEN_INDEX), bb.model.config.image_seq_length
    assert batch.inputs["input_ids"][0].tolist() == want[:at] + [bb.image_token_id] * n_image + want[at + 1:]
    embeds, _ = bb.input_embeddings(batch)
    mine = bb.logits(embeds, batch.inputs["attention_mask"])[0]
    theirs = bb.model(**bb.model_inputs(batch)).logits[0]
    scale = float(theirs.abs().max())
    assert scale > 1.0
    T.compare(mine, theirs, f"{layout}: logits (sentencepiece fixture)", 1e-5, scale)


def test_both_layouts_convert_to_the_same_weights(converted):
    _, out = converted
    a = {k: v for f in out["llava"].glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    b = {k: v for f in out["vicuna"].glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["language_model.model.embed_tokens.weight"].shape[0] >= 300
