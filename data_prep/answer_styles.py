"""Answer Style Diversification (ASD; Chen et al., ICML 2025, "SEFE"): part of a task's training instructions
rewritten into the other answer styles, so that every task trains on a similar mix of styles and a later task's
style does not overwrite an earlier task's answer format (SEFE's "superficial forgetting").

    python -m data_prep.answer_styles --in data/shards/tiny_mcit/count/train \\
        --out data/shards/tiny_mcit_asd/count/train --model data/backbones/tiny_llava [--ratio 0.2] [--seed 0]

The styles are those of the official CoIN-ASD prompts (jinpeng0528/SEFE 2f61efe, CoIN-ASD/prompts/<task>/):
``yn`` (a yes/no question about one candidate, the correct answer or a distractor), ``mcq`` (four options,
three distractors), ``brief`` and ``detail`` (the answer with a short / long explanation); the task's own
short answers are the fifth. For each transformed sample the local model (``--model``: any MLLM directory
mcit loads, text-only for a sample without an image) answers the official prompt of its style, greedily; the
distractors / explanation are read from the JSON it returns. The prompt texts below are the official VizWiz
set (one question per prompt: ``<question>``, ``<answer>``), copied as data; ``--prompts DIR`` reads another
official folder instead (``<style>.txt``; ScienceQA's ``<style>_w_image`` / ``_wo_image``; the question-list
form of VQAv2 / GQA / OCRVQA with a one-question list).

What the official repository does not publish, and is therefore this converter's own (each an option): how
many samples are transformed (``--ratio``: the README's ``train_x<X>.json`` files are X% of the data; here
round(ratio * N) samples, chosen by ``RandomState(seed).permutation`` and spread round-robin over
``--styles``), how a question list is written into the list-form prompts, and the wording of the rewritten
instruction (LLaVA's own: "Answer with the option's letter from the given choices directly." for ``mcq``).
A reply without the JSON the style needs (or whose distractors repeat the answer) leaves the sample as it was;
its record says so (``"asd": {"style": ..., "rewritten": false}``). The rewrite is deterministic (greedy
decoding, option order and yes/no candidate drawn from a generator seeded by ``--seed`` and the sample's key).
Resumable like every converter (data_prep.common); a re-run with other settings starts over.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from data_prep.common import PROGRESS, RecordError, converter_arguments, run_cli, verify, write_shards
from mcit.core.checkpoint import atomic_write_text
from mcit.data.instructions import IMAGE_EXTS, turns
from mcit.data.shards import DataError, open_split

STYLES = ("yn", "mcq", "brief", "detail")
LETTERS = "ABCD"
SETTINGS = ".answer_styles.json"
# The short-answer instruction of CoIN's / LLaVA's VQA tasks: a rewritten question says its own style instead.
SHORT_SUFFIXES = ("Answer the question using a single word or phrase.",)
INSTRUCTIONS = {
    "yn": "Is the answer \"{candidate}\"? Answer yes or no.",
    "mcq": "Answer with the option's letter from the given choices directly.",
    "brief": "Answer the question and explain the answer briefly.",
    "detail": "Answer the question and explain the answer in detail.",
}

# jinpeng0528/SEFE @ 2f61efe3a7da0407850399db6bc51f5ddc00f001, CoIN-ASD/prompts/VizWiz/{yn,mcq,brief,detail}.txt:
# (the text after <SYSTEM PROMPT>, the text after <USER PROMPT>), verbatim but for CRLF -> LF and the outer blank lines.
VIZWIZ_PROMPTS: dict[str, tuple[str, str]] = {
    "yn": (
        ('You are an AI assistant specialized in generating plausible distractor options for two-choice '
         'visual questions. Your primary task is to create a distractor option that is incorrect but '
         'plausible, aiming to challenge the user while ensuring it remains distinguishable from the correct '
         'answer.'),
        ("Given the question '<question>' and its correct answer '<answer>', generate a plausible but "
         'incorrect distractor option. This option should be similar to the correct answer to create '
         'confusion, yet still distinct enough to be clearly wrong.\n'
         '\n'
         'Your output should be formatted as follows in JSON:\n'
         '```json\n'
         '{\n'
         '    "distractor_option": "Provide the distractor option here.",\n'
         '}\n'
         '```'),
    ),
    "mcq": (
        ('You are an AI assistant specialized in generating plausible distractor options for multiple-choice '
         'visual questions. Your primary task is to create distractor options that are incorrect but '
         'plausible, aiming to challenge the user while ensuring it remains distinguishable from the correct '
         'answer.'),
        ("Given the question '<question>' and its correct answer '<answer>', generate three plausible but "
         'incorrect distractor options. These options should be similar to the correct answer to create '
         'confusion, yet still distinct enough to be clearly wrong.\n'
         '\n'
         'Your output should be formatted as follows in JSON:\n'
         '```json\n'
         '{\n'
         '    "distractor_options": [\n'
         '        "Distractor option 1",\n'
         '        "Distractor option 2",\n'
         '        "Distractor option 3"\n'
         '    ]\n'
         '}\n'
         '```'),
    ),
    "brief": (
        ('You are an AI assistant specialized in Visual Q&A. Your task is to provide precise and concise '
         'explanations based on the provided visual questions and answers.'),
        ("Given the question '<question>' and its correct answer '<answer>', generate a concise explanation "
         'that supports the answer. Emphasize the clarity, relevance, and accuracy of the explanation, and '
         'use specific visual cues from the image when necessary.\n'
         '\n'
         'Your output should be formatted as follows in JSON:\n'
         '```json\n'
         '{\n'
         '    "explanation": "Provide a brief explanation (aim for around 20 words) of the answer, focusing '
         'on key visual cues.",\n'
         '}\n'
         '```'),
    ),
    "detail": (
        ('You are an AI assistant specialized in Visual Q&A. Your task is to provide detailed and thorough '
         'explanations based on the provided visual questions and answers.'),
        ("Given the question '<question>' and its correct answer '<answer>', generate a comprehensive and "
         'detailed explanation that supports the answer. Emphasize the clarity, relevance, and accuracy of '
         'the explanation, and use specific visual cues from the image when necessary.\n'
         '\n'
         'Your output should be formatted as follows in JSON:\n'
         '```json\n'
         '{\n'
         '    "explanation": "Provide a detailed explanation (aim for around 50 words) of the answer, '
         'highlighting all potential visual cues and their relevance to the answer.",\n'
         '}\n'
         '```'),
    ),
}


@dataclass(frozen=True)
class Settings:
    """What a run's output depends on (kept beside the output: a re-run with other settings starts over)."""

    source: str
    model: str
    ratio: float
    seed: int
    styles: tuple[str, ...]
    prompts: str  # "" = the built-in official VizWiz set, else an official prompt folder
    max_new_tokens: int


def read_prompt(path: Path) -> tuple[str, str]:
    """(system, user) of an official CoIN-ASD prompt file."""
    text = path.read_text().replace("\r\n", "\n")
    if "<USER PROMPT>" not in text:
        raise DataError(f"{path}: not a CoIN-ASD prompt file (no <USER PROMPT> section)")
    system, user = text.split("<USER PROMPT>", 1)
    return system.replace("<SYSTEM PROMPT>", "").strip(), user.strip()


def prompt_for(folder: str, style: str, has_image: bool) -> tuple[str, str]:
    """The official (system, user) prompt of ``style``: the built-in set, or ``folder``'s file for it."""
    if not folder:
        return VIZWIZ_PROMPTS[style]
    d = Path(folder)
    for name in (f"{style}_{'w' if has_image else 'wo'}_image.txt", f"{style}.txt"):
        if (d / name).is_file():
            return read_prompt(d / name)
    raise DataError(f"--prompts {folder}: no prompt for style {style!r} ({style}.txt)")


def fill(user: str, question: str, answer: str) -> str:
    """The prompt with the sample's question and answer; the list form gets a one-question list."""
    if "<question_list>" in user:
        return user.replace("<question_list>", f"1. Question: {question}\n   Answer: {answer}")
    if "<question>" not in user or "<answer>" not in user:
        raise DataError("the prompt has neither <question> / <answer> nor <question_list> (ImageNet's and "
                        "Grounding's prompts are not supported)")
    return user.replace("<question>", question).replace("<answer>", answer)


def plan(n: int, ratio: float, seed: int, styles: tuple[str, ...]) -> list[str]:
    """The style of each of ``n`` samples ("" = kept): round(ratio * n) of them, in the order of
    ``RandomState(seed).permutation(n)``, take the styles in turn."""
    import numpy as np

    out = [""] * n
    order = np.random.RandomState(seed).permutation(n)[:round(ratio * n)]
    for j, i in enumerate(order):
        out[int(i)] = styles[j % len(styles)]
    return out


def sample_rng(seed: int, key: str) -> random.Random:
    """A sample's own generator (option order, yes/no candidate): the same whatever the shard plan or worker."""
    return random.Random(int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big"))


def parse(style: str, reply: str) -> dict[str, Any] | None:
    """The JSON object of a reply (the first element of a list reply), tolerating the trailing commas the
    official templates themselves show; None if there is none or it lacks the style's field."""
    start = [i for i in (reply.find("{"), reply.find("[")) if i >= 0]
    if not start:
        return None
    body = reply[min(start):]
    end = max(body.rfind("}"), body.rfind("]"))
    try:
        obj = json.loads(re.sub(r",\s*([}\]])", r"\1", body[:end + 1]))
    except ValueError:
        return None
    if isinstance(obj, list):
        obj = obj[0] if obj and isinstance(obj[0], dict) else None
    if not isinstance(obj, dict):
        return None
    field = {"yn": "distractor_option", "mcq": "distractor_options"}.get(style, "explanation")
    value = obj.get(field)
    if style == "mcq":
        ok = isinstance(value, list) and len(value) >= 3 and all(isinstance(v, str) and v.strip() for v in value[:3])
    else:
        ok = isinstance(value, str) and bool(value.strip())
    return obj if ok else None


def rewritten(style: str, question: str, answer: str, reply: dict[str, Any], rng: random.Random
              ) -> tuple[str, str, dict[str, Any]] | None:
    """(question, answer, extra record fields) in ``style``; None if the distractors do not differ from the
    answer and from each other."""
    q = question.strip()
    for suffix in SHORT_SUFFIXES:
        q = q.removesuffix(suffix).strip()
    norm = answer.strip().lower()
    if style == "yn":
        distractor = reply["distractor_option"].strip()
        if distractor.lower() == norm:
            return None
        correct = rng.random() < 0.5
        candidate = answer if correct else distractor
        return f"{q}\n{INSTRUCTIONS['yn'].format(candidate=candidate)}", "Yes" if correct else "No", {}
    if style == "mcq":
        options = [answer] + [d.strip() for d in reply["distractor_options"][:3]]
        if len({o.lower() for o in options}) < 4:
            return None
        rng.shuffle(options)
        letter = LETTERS[options.index(answer)]
        listed = "\n".join(f"{LETTERS[i]}. {o}" for i, o in enumerate(options))
        return f"{q}\n{listed}\n{INSTRUCTIONS['mcq']}", letter, {"choices": options}
    explanation = reply["explanation"].strip()
    return f"{q}\n{INSTRUCTIONS[style]}", f"{answer.strip()}. {explanation}", {}


@functools.lru_cache(maxsize=1)
def _model(path: str) -> Any:
    import torch

    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(path)
    return bb.to("cuda") if torch.cuda.is_available() else bb


def rewrite(model: str, prompt: str, sample: dict[str, Any], max_new_tokens: int) -> str:
    """The local model's greedy reply to ``prompt`` about ``sample``'s image (none for a text-only sample)."""
    import torch

    bb = _model(model)
    image = {e: sample[e] for e in IMAGE_EXTS if e in sample}
    human = f"<image>\n{prompt}" if image else prompt
    rec = {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": ""}]}
    if not image:
        rec["text_only"] = True
    row = {"__key__": sample["__key__"], "json": json.dumps(rec).encode(), **image}
    batch = bb.make_collate(None, 0, train=False)([row])
    with torch.no_grad():
        batch = batch.to(next(bb.parameters()).device)
        embeds, _ = bb.input_embeddings(batch)
        return bb.generate(embeds, batch.inputs["attention_mask"], max_new_tokens, bb.positions(batch))[0]


@functools.lru_cache(maxsize=2)
def _shard(location: str, index: int) -> list[dict]:
    return list(open_split(location).shard_samples(index))


def encode(settings: Settings, spec: tuple[int, int, str, str]) -> dict:
    """One output sample: the input sample as it is, or its last turn rewritten in the planned style."""
    shard, pos, key, style = spec
    sample = dict(_shard(settings.source, shard)[pos])
    if sample["__key__"] != key:
        raise RecordError(key, settings.source, "the input split changed during the conversion")
    sample.pop("__url__", None)
    if not style:
        return sample
    rec = json.loads(sample["json"])
    pairs = turns(rec.get("conversations"), f"sample {key} in {settings.source}")
    question, answer = pairs[-1]
    image = question.startswith("<image>")
    q = question.removeprefix("<image>").lstrip("\n")
    system, user = prompt_for(settings.prompts, style, any(e in sample for e in IMAGE_EXTS))
    reply = parse(style, rewrite(settings.model, f"{system}\n\n{fill(user, q, answer)}", sample,
                                 settings.max_new_tokens))
    out = rewritten(style, q, answer, reply, sample_rng(settings.seed, key)) if reply is not None else None
    rec["asd"] = {"style": style, "rewritten": out is not None}
    if out is not None:
        new_q, new_a, extra = out
        rec["conversations"] = rec["conversations"][:-2] + [
            {"from": "human", "value": f"<image>\n{new_q}" if image else new_q}, {"from": "gpt", "value": new_a}]
        rec["answers"] = [new_a]
        rec.pop("choices", None)
        rec.update(extra)
    sample["json"] = json.dumps(rec).encode()
    return sample


def convert(source: Path, out: Path, *, model: Path, ratio: float = 0.2, seed: int = 0,
            styles: tuple[str, ...] = STYLES, prompts: Path | None = None, max_new_tokens: int = 256,
            shard_size: int = 1000, workers: int = 1, on_error: str = "fail", progress: bool = True) -> dict:
    """Write the ASD version of the instruction split ``source`` to ``out`` (see the module docstring)."""
    if not 0 <= ratio <= 1:
        raise DataError(f"--ratio {ratio} is not a fraction in [0, 1]")
    bad = [s for s in styles if s not in STYLES]
    if bad or not styles:
        raise DataError(f"--styles {list(styles)}: each must be one of {list(STYLES)}")
    split = open_split(source)
    if split.manifest.get("kind") != "instruction":
        raise DataError(f"{source}: not an instruction split (manifest kind {split.manifest.get('kind')!r})")
    if not Path(str(model)).is_dir():
        raise DataError(f"--model {model}: not a model directory")
    settings = Settings(str(source), str(model), ratio, seed, tuple(styles), str(prompts or ""), max_new_tokens)
    for style in styles:  # the prompt files exist before any model is loaded
        prompt_for(settings.prompts, style, True)
    keys = [(k, i, s["__key__"]) for k in range(len(split.manifest["shards"]))
            for i, s in enumerate(split.shard_samples(k))]
    chosen = plan(len(keys), ratio, seed, tuple(styles))
    specs = [(k, i, key, style) for (k, i, key), style in zip(keys, chosen)]
    out.mkdir(parents=True, exist_ok=True)
    mine = json.dumps(asdict(settings), sort_keys=True)
    if (out / SETTINGS).is_file() and (out / SETTINGS).read_text() != mine:
        (out / PROGRESS).unlink(missing_ok=True)  # another run's partial output: start over
    atomic_write_text(out / SETTINGS, mine)
    kept = {k: v for k, v in split.manifest.items()
            if k not in ("format", "num_samples", "label_space", "class_names", "shards", "skipped", "skipped_records")}
    info = {**asdict(settings), "styles": list(styles), "source_samples": len(keys),
            "planned": {s: chosen.count(s) for s in styles},
            "prompt_source": "jinpeng0528/SEFE@2f61efe CoIN-ASD/prompts"}
    manifest = write_shards(out, specs, functools.partial(encode, settings), shard_size=shard_size,
                            label_space=split.label_space, class_names=split.manifest.get("class_names"),
                            extra={**kept, "answer_styles": info}, on_error=on_error, workers=workers,
                            progress=progress, desc="answer styles")
    (out / SETTINGS).unlink(missing_ok=True)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = converter_arguments(__doc__)
    ap.add_argument("--in", "--input", dest="input", type=Path, help="the instruction split to diversify")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", type=Path, help="a local model directory mcit loads (the rewriter)")
    ap.add_argument("--ratio", type=float, default=0.2, help="fraction of samples rewritten (X / 100; 0.2: X = 20)")
    ap.add_argument("--seed", type=int, default=0, help="which samples, which style each, option order")
    ap.add_argument("--styles", nargs="+", default=list(STYLES), choices=list(STYLES))
    ap.add_argument("--prompts", type=Path, help="an official CoIN-ASD prompt folder (default: the VizWiz set)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    return run_cli(ap, argv, lambda a: convert(
        a.input, a.out, model=a.model, ratio=a.ratio, seed=a.seed, styles=tuple(a.styles), prompts=a.prompts,
        max_new_tokens=a.max_new_tokens, shard_size=a.shard_size, workers=a.workers, on_error=a.on_error,
        progress=not a.no_progress),
        lambda a, m: f"{a.out}: {m['num_samples']} samples, planned styles {m['answer_styles']['planned']}",
        required=("input", "out", "model"), verify_fn=verify)


if __name__ == "__main__":
    raise SystemExit(main())
