"""ModalPrompt against its official code (official/modal_prompt.json: AuroraZengfh/ModalPrompt's ``ModalPrompt`` model,
``prepare_inputs_labels_for_multimodal``, the trainer's loss and embedding reset; and MCITlib's copy), run on the same
tiny inputs.

The fixture: the tiny LLaVA-1.5 of tests/reference/llava_original.py (its original layout for the official code,
converted by data_prep/convert_llava.py for ours) and a tiny CLIP as the guide encoders (``guide_clip/``, written
here: the same vision tower and projection as the LLaVA's CLIP, a text encoder whose width is the projection's, 16,
as CLIP ViT-L/14's text width is its projection width, 768, and a word-level tokenizer); 4 tasks of 2 training
samples each (of different lengths: right padding), 2 prompt vectors per task, the official transfer_num 3 and
lam 0.5, 3 SGD steps per task, every prompt and prototype head set from one seeded generator on both sides
(``initial_values``).

Pinned per task: CLIP's texts, both guide features, the cosine similarity of each to every seen prototype, which
tasks' prompts go where in training (the last task chooses 2 of 3 earlier tasks, differently per sample), the
answer-token, image and text alignment losses of every step (so every update of the prompt, head and projector
before it), the gradient of the task's prompt, of the head's output layer (every layer at the first task) and of
the projector (first task), the prompt's update; after each task, for three samples in one left-padded batch, each
compared with the official run of it alone: the inference selection and similarities, the next-token logits and the
greedy answer. The last task is the one where the official code leaves its prompt untrained; the official numbers
are those of its reset mask made right (the JSON's ``harness``). MCITlib's copy (transfer_num 1, frozen projector):
the selections, similarities, losses, the prompt's gradient and update, the logits and answers.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import tiny_inputs as T
import torch

HERE = Path(__file__).resolve().parent
TASKS, PREFIX, TRANSFER, LAM, STEPS, LR = 4, 2, 3, 0.5, 3, 0.5
GUIDE_TEXT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "vocab_size": 64, "max_position_embeddings": 16, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5,
              "projection_dim": 16, "bos_token_id": 62, "eos_token_id": 63, "pad_token_id": 1}
# (question, answer, image) of each task's two training samples; the answers of a task have one token count
TRAIN = [[("<image>\nwhat colour is the shape?", "red", 0),
          ("<image>\nwhat colour is the shape in the image?", "blue", 1)],
         [("<image>\nhow many dots?\nanswer with one word.", "three", 2), ("<image>\nhow many dots?", "two", 3)],
         [("<image>\nwhat is in the image?", "a red square", 4),
          ("<image>\nwhat is in the image?\nanswer with one word.", "a blue square", 5)],
         [("<image>\nwhat colour is the background?", "green", 6),
          ("<image>\nwhat colour is the background in the image?", "yellow", 7)]]
EVAL = [("<image>\nwhat colour is the shape?", 8), ("<image>\nhow many dots?\nanswer with one word.", 9),
        ("<image>\nwhat colour is the background in the image?", 10)]
CLIP_WORDS = ["what", "colour", "is", "the", "shape", "how", "many", "dots", "answer", "with", "one", "word", "in",
              "image", "background", "?", "."]


# -- the fixture (also what the official run was fed: /work/scratch/modal_prompt/prepare.py) -------------------------
def image(i: int):
    """A 40 x 24 RGB gradient with a coloured rectangle: the shape, colour and place change with ``i``."""
    from PIL import Image

    img = Image.new("RGB", (40, 24))
    img.putdata([((6 * x + 20 * i) % 256, (10 * y + 35 * i) % 256, (128 + 3 * x - 4 * y + 50 * i) % 256)
                 for y in range(24) for x in range(40)])
    colour = [(220, 30, 40), (30, 40, 220), (40, 200, 60), (230, 220, 30)][i % 4]
    x0, y0 = 2 + (7 * i) % 24, 2 + (5 * i) % 10
    img.paste(colour, (x0, y0, x0 + 8 + i % 5, y0 + 8))
    return img


def sample(question: str, answer: str | None, i: int, key: str) -> dict:
    buf = io.BytesIO()
    image(i).save(buf, format="PNG")
    conv = [{"from": "human", "value": question}, {"from": "gpt", "value": answer or ""}]
    return {"__key__": key, "png": buf.getvalue(), "json": json.dumps({"conversations": conv}).encode()}


def clip_tokenizer():
    """A word-level, lower-casing tokenizer for the guide CLIP's 64-token vocabulary: ``<bos>`` 62, ``<eos>`` 63 (the
    largest id, so the official CLIP pooling at the argmax of the ids and transformers' at the first end-of-text
    pick the same position), padding with ``<eos>``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, **{w: 2 + i for i, w in enumerate(CLIP_WORDS)}, "<bos>": 62, "<eos>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                       special_tokens=[("<bos>", 62), ("<eos>", 63)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>",
                                   unk_token="<unk>", model_input_names=["input_ids", "attention_mask"])


def guide_clip(clip_dir: Path, out: Path) -> Path:
    """``out``: a CLIPModel directory with ``clip_dir``'s vision tower, visual projection and logit scale and a
    seeded 16-wide text encoder and text projection (N(0, 0.1^2) weights, 1 + 0.1 N norms, 0.05 N biases, in sorted
    key order from Generator seed 11), its preprocessor config and the word-level tokenizer."""
    import llava_original as L
    from safetensors.torch import load_file, save_file
    from transformers import CLIPConfig, CLIPModel

    out.mkdir(parents=True, exist_ok=True)
    src = json.loads((clip_dir / "config.json").read_text())
    cfg = {**src, "text_config": {**src["text_config"], **GUIDE_TEXT}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CLIPModel(CLIPConfig.from_dict(cfg)).state_dict().items()}
    vision = load_file(str(clip_dir / "model.safetensors"))
    weights = {k: v for k, v in vision.items() if not k.startswith(("text_model.", "text_projection."))}
    g = torch.Generator().manual_seed(11)
    for name in sorted(k for k in shapes if k.startswith(("text_model.", "text_projection."))):
        x = torch.randn(shapes[name], generator=g)
        module = name.rsplit(".", 1)[0].split(".")[-1]
        weights[name] = (0.05 * x if name.endswith("bias") else 1 + 0.1 * x if "norm" in module else 0.1 * x)
    assert set(weights) == set(shapes) and all(tuple(weights[k].shape) == shapes[k] for k in shapes)
    save_file({k: weights[k].contiguous() for k in sorted(weights)}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "preprocessor_config.json").write_text((clip_dir / "preprocessor_config.json").read_text())
    tok = clip_tokenizer()
    tok.save_pretrained(out)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes its alias, 4.31 reads this name
    tc["model_input_names"] = ["input_ids", "attention_mask"]  # as CLIP's tokenizer: no token_type_ids
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    assert L.CLIP_VISION["hidden_size"] == 32
    return out


def build(base: Path) -> dict[str, Path]:
    """The tiny LLaVA in its original layout (src/), the guide CLIP (guide_clip/) and our converted LLaVA (hf/)."""
    import llava_original as L

    from data_prep.convert_llava import check_sources, convert

    paths = L.build(base / "src")
    paths["guide_clip"] = guide_clip(paths["clip"], base / "guide_clip")
    paths["hf"] = base / "hf"
    convert(check_sources(paths["llava"], None, None, paths["clip"]), paths["hf"], progress=False)
    return paths


def initial_values(table: torch.Tensor, vocab: int, hidden: int, width: int) -> dict[str, torch.Tensor]:
    """Every task's prompt (copies of vocabulary rows drawn by Generator seed 12, the official initialisation) and
    prototype head (weights 0.15 N, biases 0.05 N, from the same generator), as ``prompt{t}`` /
    ``transforms.{t}.{0,2}.{weight,bias}`` in our state dict."""
    g = torch.Generator().manual_seed(12)
    rows = torch.randint(0, vocab, (TASKS * PREFIX,), generator=g)
    out = {f"prompt{t}": table[rows[t * PREFIX:(t + 1) * PREFIX]].float().clone() for t in range(TASKS)}
    for t in range(TASKS):
        for layer, (o, i) in ((0, (hidden, hidden)), (2, (width, hidden))):
            out[f"transforms.{t}.{layer}.weight"] = 0.15 * torch.randn(o, i, generator=g)
            out[f"transforms.{t}.{layer}.bias"] = 0.05 * torch.randn(o, generator=g)
    return out


def batches(bb):
    """(training batch of each task, evaluation batch of the three EVAL samples) through our collate."""
    train = [bb.make_collate(None, t, train=True)([sample(q, a, i, f"t{t}s{j}") for j, (q, a, i) in enumerate(rows)])
             for t, rows in enumerate(TRAIN)]
    ev = bb.make_collate(None, 0, train=False)([sample(q, None, i, f"e{j}") for j, (q, i) in enumerate(EVAL)])
    return train, ev


def original_row(ids: torch.Tensor, values: torch.Tensor, image_token: int) -> list[int]:
    """``values`` (a row of ids or labels) as LLaVA's code holds the row: the run of image tokens of ``ids`` one
    position, -200 (IMAGE_TOKEN_INDEX) for ids, -100 for labels."""
    out: list[int] = []
    prev = False
    for x, v in zip(ids.tolist(), values.tolist()):
        if x == image_token:
            if not prev:
                out.append(-200 if v == x else -100)
            prev = True
        else:
            out.append(v)
            prev = False
    return out


# -- the comparison -------------------------------------------------------------------------------------------------
SCALES: dict[str, float] = {}  # every compared quantity's largest official magnitude (printed: the fixture's scales)


TOL = T.TOLERANCE["modal_prompt"]


def close(ours: torch.Tensor, ref, what: str, unit: float = 0.0) -> None:
    """Within TOL of the official quantity's own scale (its largest magnitude), which must be far from zero, or of
    ``unit`` where that is larger: a cosine rounds at the scale of its unit vectors, whatever its value (1 - cos of
    0.99 is 0.01 with the rounding of 1; measured: 6e-8 across CPU kernel sets, 6e-6 of such a scale)."""
    scale = float(T.as_tensor(ref).abs().max())
    assert scale > 1e-3, f"{what}: official scale {scale:.3g} is too close to trivial"
    SCALES[what.split(" (")[0]] = max(SCALES.get(what.split(" (")[0], 0.0), scale)
    T.compare(ours, ref, what, TOL, max(scale, unit))


@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    """(official record, our LLaVA, the guide CLIP): the files the official code ran on, rebuilt and checked."""
    import llava_original as L

    from mcit.models.base import load_backbone

    L.skip_unless_this_randn_draws_the_weights()
    ref = T.official("modal_prompt")
    paths = build(tmp_path_factory.mktemp("modal_prompt"))
    assert L.weight_sha256(paths) == T.official("llava15")["sha256"]  # the tiny LLaVA LLaVA's own code ran on
    for name, digest in ref["setup"]["guide_clip_sha256"].items():
        assert hashlib.sha256((paths["guide_clip"] / name).read_bytes()).hexdigest() == digest, name
    bb = load_backbone("llava", str(paths["hf"]), chat_format="vicuna_v1")
    # LLaVA's own model has the vocabulary's 219 output columns; the converted one adds llava-hf's <image>, <pad> and
    # padding rows (data_prep/convert_llava.py): the answer-token loss here is over LLaVA's columns, as the official one
    full = bb.logits
    bb.logits = lambda embeds, mask, positions=None: full(embeds, mask, positions)[..., : ref["setup"]["vocab"]]
    return ref, bb, load_backbone("clip", str(paths["guide_clip"]))


def _inputs_are_the_officials(bb, train, ev, setup: dict) -> None:
    img = bb.image_token_id
    for t, b in enumerate(train):
        am = b.inputs["attention_mask"].bool()
        for i in range(len(am)):
            r = b.inputs["input_ids"][i][am[i]]
            n = len(original_row(r, r, img))
            assert original_row(r, r, img) == setup["train_input_ids"][t][i][:n]
            assert original_row(r, b.labels[i][am[i]], img) == setup["train_labels"][t][i][:n]
        T.assert_close(b.pixel_values.double().sum((1, 2, 3)), setup["train_pixel_sums"][t], f"task {t} pixels")
    for j in range(ev.pixel_values.shape[0]):
        r = ev.inputs["input_ids"][j][ev.inputs["attention_mask"][j].bool()]
        assert original_row(r, r, img) == setup["eval_input_ids"][j]
        T.assert_close(ev.pixel_values[j].double().sum(), setup["eval_pixel_sums"][j], f"eval sample {j} pixels")


def _method(bb, clip, seed: int = 0, **params):
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence

    cls = METHODS.get("modal_prompt")
    seq = TaskSequence.from_label_spaces([f"t{t}" for t in range(TASKS)], [[] for _ in range(TASKS)])
    torch.manual_seed(seed)
    return cls(cls.Params(clip_path="guide_clip", **params), bb, seq, auxiliary={"clip": clip})


def _replay(m, bb, train, ev, values: dict, init: dict) -> None:
    """Every task's SGD steps and the inference after it, compared with the official run's ``values`` (what they
    hold: the official repository's run keeps more than MCITlib's)."""
    for t in range(TASKS):
        rec, batch = values["train"][t], train[t]
        m.set_task(t)
        m.before_task(t)
        m.train()
        opt = torch.optim.SGD(m.trainable_parameters(), lr=LR)
        for s, want in enumerate(rec["steps"]):
            out = m.train_outputs(batch)
            terms = m.loss(batch, out)
            if s == 0:
                if "clip_texts" in rec:
                    assert m.instruction_texts(batch) == rec["clip_texts"]
                    embeds, query = bb.input_embeddings(batch)
                    image, text = m.guide_features(batch, embeds, query)
                    close(image, rec["image_features"], f"task {t}: CLIP image features")
                    close(text, rec["text_features"], f"task {t}: CLIP text features")
                    close(1 - out["align_image"], rec["loss_cos_image"], f"task {t}: cos(image, own prototype)",
                          unit=1.0)
                    close(1 - out["align_text"], rec["loss_cos_text"], f"task {t}: cos(text, own prototype)",
                          unit=1.0)
                close(out["cos_image"], rec["cos_image"], f"task {t}: cos(image, prototypes)", unit=1.0)
                close(out["cos_text"], rec["cos_text"], f"task {t}: cos(text, prototypes)", unit=1.0)
                assert out["selected"].tolist() == rec["selected"], f"task {t}: prompts fused in training"
            close(out["lm_loss"].mean(), want["lm"], f"task {t} step {s}: answer-token loss")
            close(out["align_image"].mean(), want["image"], f"task {t} step {s}: image alignment loss")
            close(out["align_text"].mean(), want["text"], f"task {t} step {s}: text alignment loss")
            close(terms.per_sample.mean(), want["total"], f"task {t} step {s}: total loss")
            opt.zero_grad()
            terms.per_sample.mean().backward()
            if s == 0:
                close(m.prompt(t).grad, rec["grad_prompt"], f"task {t}: gradient of the prompt")
                head = dict(m.transforms[t].named_parameters())
                for name, g in rec.get("grad_transform", {}).items():
                    close(head[name].grad, g, f"task {t}: gradient of the head's {name}")
                for name, g in rec.get("grad_projector", {}).items():
                    mine = dict(m.projector.inner.named_parameters())[name.replace("0.", "linear_1.")
                                                                      .replace("2.", "linear_2.")]
                    close(mine.grad, g, f"task {t}: gradient of the projector's {name}")
            opt.step()
        start = init[f"prompt{t}"]
        close(m.prompt(t) - start, T.as_tensor(rec["prompt_after"]) - start, f"task {t}: the prompt's update")
        # inference after task t: the three samples in one left-padded batch, each as the official one alone
        m.eval()
        want = values["eval"][t]
        with torch.no_grad():
            if "clip_texts" in want:
                assert m.instruction_texts(ev) == want["clip_texts"]
            e, mask, _, pos, extra = m.prompted_inputs(ev)
            assert extra["selected"].tolist() == want["selected"], f"after task {t}: prompts fused at inference"
            close(extra["cos_image"], want["cos_image"], f"after task {t}: inference cos(image, prototypes)", unit=1.0)
            close(extra["cos_text"], want["cos_text"], f"after task {t}: inference cos(text, prototypes)", unit=1.0)
            close(bb.logits(e, mask, pos)[:, -1, :64], want["logits"], f"after task {t}: next-token logits")
            answers = m.generate(ev, 3)
        assert answers == [bb.tokenizer.decode(g, skip_special_tokens=True).strip() for g in want["greedy"]]


def test_modal_prompt_selects_fuses_trains_and_answers_as_the_official_code(fixture):
    ref, bb, clip = fixture
    setup = ref["setup"]
    assert (setup["tasks"], setup["prefix_len"], setup["transfer_num"], setup["lam"], setup["steps"], setup["lr"]) == \
        (TASKS, PREFIX, TRANSFER, LAM, STEPS, LR)
    train, ev = batches(bb)
    _inputs_are_the_officials(bb, train, ev, setup)
    # our own initialisation draws the prompts from LLaVA's vocabulary (not the converter's added rows), as the
    # official add_prompt_tokens does (np.random.randint(vocab_size)); 160 draws
    table = bb.token_embeddings().detach().float()
    drawn = _method(bb, clip, prefix_len=40)
    rows = torch.cat([drawn.prompt(t).detach() for t in range(TASKS)])
    assert table.shape[0] > setup["vocab"] and all(bool((table[: setup["vocab"]] == r).all(1).any()) for r in rows)
    m = _method(bb, clip, prefix_len=PREFIX, transfer_num=TRANSFER, lam=LAM)  # built last: its projector is in place
    assert m.shared_prototype  # text width 16 = projection width 16, as CLIP ViT-L/14's 768 / 768
    init = initial_values(bb.token_embeddings().detach(), setup["vocab"], bb.hidden_size, 16)
    state = m.state_dict()
    assert {k for k in state if not k.startswith("projector.")} == set(init)
    m.load_state_dict({**state, **init})
    _replay(m, bb, train, ev, ref["values"], init)
    print("official scales:", {k: round(v, 4) for k, v in SCALES.items()})


def test_modal_prompt_as_mcitlibs_copy_fuses_one_prompt_and_keeps_the_projector(fixture):
    """MCITlib's copy (transfer_num 1, the projector frozen) on the same inputs: ``transfer_num: 1,
    train_projector: false``."""
    ref, bb, clip = fixture
    assert ref["mcitlib"]["source"]["commit"] == "2956dfda732c3caac86100afeaa097ae216f5dbd"
    assert not any("mm_projector" in n for n in ref["mcitlib"]["harness"]["trainable"])
    train, ev = batches(bb)
    m = _method(bb, clip, prefix_len=PREFIX, transfer_num=1, lam=LAM, train_projector=False)
    init = initial_values(bb.token_embeddings().detach(), ref["setup"]["vocab"], bb.hidden_size, 16)
    m.load_state_dict({**m.state_dict(), **init})
    pretrained = {k: v.clone() for k, v in bb.projector().state_dict().items()}
    _replay(m, bb, train, ev, ref["mcitlib"]["values"], init)
    assert all(torch.equal(v, bb.projector().state_dict()[k]) for k, v in pretrained.items())
