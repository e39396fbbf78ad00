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
    n = bb.output_vocab  # Vicuna's 300 pieces: <image>, <pad> and the padding rows are not LLaVA's outputs
    assert n == 300 and mine.shape[-1] == 320
    assert float(torch.softmax(mine.float(), -1)[:, n:].max()) == 0.0
    scale = float(theirs.abs().max())
    assert scale > 1.0
    T.compare(mine[:, :n], theirs[:, :n], f"{layout}: logits (sentencepiece fixture)", 1e-5, scale)


def test_both_layouts_convert_to_the_same_weights(converted):
    _, out = converted
    a = {k: v for f in out["llava"].glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    b = {k: v for f in out["vicuna"].glob("model-*.safetensors") for k, v in load_file(str(f)).items()}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["language_model.model.embed_tokens.weight"].shape[0] >= 300


@torch.no_grad()
def test_the_training_loss_is_llava_s_on_answers_of_different_lengths(converted):
    """official/llava_loss.json: haotian-liu/LLaVA's own training path (``preprocess_v1``'s target masking,
    ``DataCollatorForSupervisedDataset``, ``LlavaLlamaForCausalLM.forward``) on the SentencePiece fixture with six
    answers of 1 to 9 words in one micro-batch. mcit's collate supervises the same tokens of each answer, and the
    engine's objective (``step_loss``, ``train.lm_loss_mean: token``) is the official loss: the mean over every
    answer token of the batch, also when the batch is split into two accumulation steps (the window's token count
    normalises both; LLaVA's 4.37 trainer would average the two micro-batch means instead, the official
    ``microbatch_loss_mean``). The per-sample mean (``sample``) is the official ``mean_of_sample_means``, another
    objective. Noise over the kernel sets (tests/numerics.py's AVX2, one thread, MKL_CBWR=COMPATIBLE, oneDNN AVX2):
    loss 4.8e-7, sums 1.5e-5; without the masked rows the sums move by 1.9, the per-sample mean by 0.14."""
    import json
    from pathlib import Path

    import llava_original as L

    from mcit.core.config import TrainConfig
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence
    from mcit.models.base import load_backbone
    from mcit.run.engine import step_loss

    L.skip_unless_this_randn_draws_the_weights()
    ref = json.loads((Path(__file__).parent / "official" / "llava_loss.json").read_text())["values"]
    _, out = converted
    bb = load_backbone("llava", str(out["llava"]), chat_format="vicuna_v1")
    collate = bb.make_collate(None, 0, train=True)
    samples = L.loss_samples(L.image())
    assert [json.loads(s["json"])["conversations"][1]["value"] for s in samples] == \
        [r["answer"] for r in ref["samples"]]
    full = collate(samples)
    for i, r in enumerate(ref["samples"]):  # the supervised tokens: the answer and </s>, as preprocess_v1 masks
        theirs = [t for t in r["labels"] if t != -100]
        mine = [t for t in full.labels[i].tolist() if t != -100]
        assert mine == theirs, (i, mine, theirs)
    cls = METHODS.get("lora")
    m = cls(cls.Params(r=2), bb, TaskSequence.from_label_spaces(["c"], [[]]))  # B = 0: the checkpoint's model

    def objective(parts: list[list[int]], mode: str) -> float:
        batches = [collate([samples[i] for i in p]) for p in parts]
        n_tokens = sum(m.answer_tokens(b) for b in batches)
        gas = len(parts)
        return sum(float(step_loss(m(b), b.valid, gas / len(samples), gas / n_tokens if mode == "token" else None))
                   for b in batches) / gas

    terms = m(full)
    sums, counts = terms.tokens
    assert counts.tolist() == ref["per_sample_tokens"]
    T.compare(sums, torch.tensor(ref["per_sample_sum"]), "per-sample answer-token sums", 1e-6, 200.0)
    default = TrainConfig().lm_loss_mean  # what a run does unless its config says otherwise
    assert m.token_loss  # the engine counts the window's answer tokens for this method
    T.compare(torch.tensor(objective([[0, 1, 2, 3, 4, 5]], default)), torch.tensor(ref["loss"]), "loss", 5e-6, 1.0)
    T.compare(torch.tensor(objective([[0, 1, 2], [3, 4, 5]], default)), torch.tensor(ref["loss"]),
              "loss over two accumulation steps", 5e-6, 1.0)
    per_sample = objective([[0, 1, 2, 3, 4, 5]], "sample")
    T.compare(torch.tensor(per_sample), torch.tensor(ref["mean_of_sample_means"]), "per-sample mean", 5e-6, 1.0)
    assert abs(per_sample - ref["loss"]) > 1e4 * 5e-6  # the option is another objective, far beyond the tolerance
