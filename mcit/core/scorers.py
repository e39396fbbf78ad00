"""Per-task scorers of generated answers: each maps (prediction, reference meta) to a score in [0, 1].

The normalisation follows the VQA evaluation script's spirit (lower case, punctuation and articles
removed, number words to digits), so "Three." and "3" match.
"""

from __future__ import annotations

import re
from typing import Any, Callable

Scorer = Callable[[str, dict[str, Any]], float]
SCORERS: dict[str, Scorer] = {}

_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
            "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}
_PUNCT = re.compile(r"[;/\[\]\"{}()=+\\_\-><@`,?!*#%^&$~|:]")


def normalize(text: str) -> str:
    t = text.lower().replace("\n", " ").strip()
    t = _PUNCT.sub(" ", t)
    t = re.sub(r"(?<!\d)\.|\.(?!\d)", " ", t)  # full stops (also "3." at a sentence end), not decimal points
    words = [_NUMBERS.get(w, w) for w in t.split() if w not in _ARTICLES]
    return " ".join(words)


def register(name: str) -> Callable[[Scorer], Scorer]:
    def deco(fn: Scorer) -> Scorer:
        SCORERS[name] = fn
        return fn

    return deco


# What a scorer needs of a split's references, read from the manifest's "references" (data_prep writes it:
# samples, answers_min / answers_max per sample, with_size, annotations_format): a check returns why the split
# falls short (naming the file to convert it with), or None. Pre-flight refuses such a split: scored anyway,
# it gives 0 or another benchmark's number without a word (m4c's TextVQA evaluator with one answer).
Requirement = Callable[[dict[str, Any], str], "str | None"]
REQUIRES: dict[str, Requirement] = {}


def requires(*names: str) -> Callable[[Requirement], Requirement]:
    def deco(fn: Requirement) -> Requirement:
        for name in names:
            REQUIRES[name] = fn
        return fn

    return deco


def unmet(name: str, manifest: dict[str, Any], task: str) -> str | None:
    """Why the split with ``manifest`` cannot be scored by ``name`` as its benchmark does, or None."""
    check = REQUIRES.get(name)
    if check is None:
        return None
    refs = manifest.get("references")
    if not isinstance(refs, dict):
        return (f"scorer {name} needs to know what the split's references hold, and its manifest does not say "
                f"(written before data_prep recorded it, or by another tool): convert it again with data_prep")
    return check(refs, task)


@requires("coin_textvqa")
def _ten_answers(refs: dict[str, Any], task: str) -> str | None:
    if refs.get("answers_min") == refs.get("answers_max") == 10:
        return None
    have = refs.get("answers_min"), refs.get("answers_max")
    have_text = f"{have[0]}" if have[0] == have[1] else f"{have[0]}-{have[1]}"
    return (f"scorer coin_textvqa scores against the 10 annotator answers of each question (m4c's "
            f"TextVQAAccuracyEvaluator), and this split has {have_text}: convert its test file with "
            f"--annotations {task}=TextVQA_0.5.1_val.json")


@requires("coin_grounding", "coin_grounding_official", "coin_grounding_parsed")
def _sizes(refs: dict[str, Any], task: str) -> str | None:
    if refs.get("with_size") == refs.get("samples"):
        return None
    return (f"scorer coin_grounding scales both boxes by each image's max(width, height), and "
            f"{refs.get('samples', 0) - (refs.get('with_size') or 0)} of the split's records have no 'size': "
            f"convert CoIN's Grounding/test.json, whose records carry it")


@requires("ucit_caption")
def _caption_file(refs: dict[str, Any], task: str) -> str | None:
    if refs.get("annotations_format") == "coco_captions":
        return None
    return (f"scorer ucit_caption scores against the COCO caption file MCITlib's eval_caption.py reads (its "
            f"anno_path: every reference caption of each image), and this split was converted without one: "
            f"convert its test file with --annotations {task}=<the COCO caption file>")


@requires("mllm_cl_sci")
def _image_names(refs: dict[str, Any], task: str) -> str | None:
    if refs.get("with_image_name") == refs.get("samples"):
        return None
    return ("scorer mllm_cl_sci picks its rule by each record's image file name (AI2D_, TQA_, VQA_, SciVerse_ or "
            "MapQA), and some records have none: convert MLLM-DCL's Sci/test.json with data_prep.mllm_dcl")


@requires("mllm_cl_ocrbench")
def _ocr_categories(refs: dict[str, Any], task: str) -> str | None:
    if refs.get("with_answer_type") == refs.get("samples"):
        return None
    return ("scorer mllm_cl_ocrbench reads each record's OCRBench category ('answer_type'), and some records have "
            "none: convert MLLM-ACL's OCR_test/test.json with data_prep.mllm_acl")


@requires("mllm_cl_math")
def _mathvista_table(refs: dict[str, Any], task: str) -> str | None:
    if refs.get("annotations_format") == "mathvista":
        return None
    return (f"scorer mllm_cl_math reads each question's row of MathVista's answer table (its type, options and "
            f"answer), and this split was converted without it: convert MLLM-ACL's Math_test/test.json with "
            f"--annotations {task}=llava_v1.5_7b_MathVista_MINI.xlsx")


def get(name: str) -> Scorer:
    if name not in SCORERS:
        raise KeyError(f"unknown scorer {name!r}; known: {', '.join(sorted(SCORERS))}")
    return SCORERS[name]


@register("exact_match")
def exact_match(pred: str, ref: dict[str, Any]) -> float:
    """1 if the normalised prediction equals the normalised answer (or any reference answer)."""
    p = normalize(pred)
    return float(any(p == normalize(a) for a in ref.get("answers") or [ref["answer"]]))


@register("vqa_accuracy")
def vqa_accuracy(pred: str, ref: dict[str, Any]) -> float:
    """The official VQA evaluation's accuracy (GT-Vision-Lab/VQA vqaEval.py): the answers and the prediction
    lose newlines, tabs and outer spaces; only when the annotators disagree (more than one distinct answer)
    are all of them normalised (punctuation, then lower case, number words, articles, contractions); the
    score is min(#other annotators with this answer / 3, 1) averaged over leaving each annotator out. So with
    ten identical answers "Yes" does not match "yes", as there. A single reference answer (no annotators:
    the official formula would always give 0) is compared after the same normalisation."""
    answers = [_vqa_clean(a) for a in ref.get("answers") or [ref["answer"]]]
    p = _vqa_clean(pred)
    if len(answers) == 1 or len(set(answers)) > 1:
        answers = [vqa_normalise(a) for a in answers]
        p = vqa_normalise(p)
    if len(answers) == 1:
        return float(p == answers[0])
    return _soft_score(p, answers)


def _soft_score(p: str, answers: list[str]) -> float:
    """min(#other annotators who gave ``p`` / 3, 1), averaged over leaving each annotator out."""
    accs = [min(1.0, sum(1 for j, a in enumerate(answers) if j != i and a == p) / 3) for i in range(len(answers))]
    return sum(accs) / len(accs)


def _vqa_clean(text: str) -> str:
    return text.replace("\n", " ").replace("\t", " ").strip()


_VQA_PUNCTUATIONS = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",",
                     "?", "!")
_VQA_COMMA_STRIP = re.compile(r"(\d)(\,)(\d)")
_VQA_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")


def vqa_normalise(text: str) -> str:
    r"""vqaEval.py's processPunctuation + processDigitArticle: punctuation deleted outright when the text has
    a space beside it or a digit comma digit, else replaced by a space; full stops not before a digit
    deleted; lower case, number words to digits, articles dropped, contractions restored. Two quirks of
    that code are kept because they decide scores: its full-stop pattern ``(?!<=\d)`` is a look-ahead
    typo (a full stop after a digit goes too), and ``sub`` receives ``re.UNICODE`` as its count, so at
    most 32 full stops go."""
    out = text
    for p in _VQA_PUNCTUATIONS:
        if p + " " in text or " " + p in text or _VQA_COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    out = _VQA_PERIOD_STRIP.sub("", out, count=int(re.UNICODE))
    words = [_NUMBERS.get(w, w) for w in out.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))


@register("multiple_choice")
def multiple_choice(pred: str, ref: dict[str, Any]) -> float:
    """The first option letter of the prediction ("B", "(B)", "B. text", "Answer: B") equals the answer's."""

    def letter(text: str) -> str | None:
        t = text.strip()
        m = re.match(r"^(?:answer\s*[:is]*\s*)?\(?([A-Za-z])\)?(?:[.):\s]|$)", t, flags=re.I)
        return m.group(1).upper() if m else None

    return float(letter(pred) is not None and letter(pred) == letter(ref["answer"]))


@register("contains")
def contains(pred: str, ref: dict[str, Any]) -> float:
    """1 if the normalised answer occurs in the normalised prediction as whole words."""
    p = f" {normalize(pred)} "
    return float(any(f" {normalize(a)} " in p for a in ref.get("answers") or [ref["answer"]] if normalize(a)))


def parse_box(text: str) -> list[float] | None:
    nums = re.findall(r"-?\d+(?:\.\d+)?", text)
    if len(nums) < 4:
        return None
    return [float(x) for x in nums[:4]]


def box_iou(a: list[float], b: list[float]) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    area = lambda r: max(0.0, r[2] - r[0]) * max(0.0, r[3] - r[1])  # noqa: E731
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


@register("grounding_iou")
def grounding_iou(pred: str, ref: dict[str, Any]) -> float:
    """1 if the predicted box [x0, y0, x1, y1] has IoU >= 0.5 with the reference box."""
    box = parse_box(pred)
    target = ref.get("box") or parse_box(ref["answer"])
    if box is None or target is None:
        return 0.0
    return float(box_iou(box, [float(v) for v in target]) >= 0.5)


# --------------------------------------------------------------------------------------------------
# CoIN's evaluation scripts (zackschen/CoIN 4122465, ETrain/Eval/LLaVA/CoIN/), one scorer per task, so that a
# CoIN sequence is scored as the published tables are. The CoIN answer ("answer" in the sample's meta) is the
# instruction file's single answer; TextVQA's ten annotator answers come from TextVQA_0.5.1_val.json ("answers").

_SQA_OPTIONS = ("A", "B", "C", "D", "E")

# The VQA evaluation's contraction table (words written without apostrophes -> with them).
_CONTRACTIONS = {
    "'ow'sat": "'ow's'at", "'ows'at": "'ow's'at", "I'dve": "I'd've", "Id've": "I'd've", 'Im': "I'm", 'Ive': "I've",
    'aint': "ain't", 'arent': "aren't", 'cant': "can't", "couldn'tve": "couldn't've", 'couldnt': "couldn't",
    "couldnt've": "couldn't've", 'couldve': "could've", 'didnt': "didn't", 'doesnt': "doesn't", 'dont': "don't",
    "hadn'tve": "hadn't've", 'hadnt': "hadn't", "hadnt've": "hadn't've", 'hasnt': "hasn't", 'havent': "haven't",
    "he'dve": "he'd've", 'hed': "he'd", "hed've": "he'd've", 'hes': "he's", 'howd': "how'd", 'howll': "how'll",
    'hows': "how's", 'isnt': "isn't", "it'dve": "it'd've", 'itd': "it'd", "itd've": "it'd've", 'itll': "it'll",
    "let's": "let's", 'maam': "ma'am", "mightn'tve": "mightn't've", 'mightnt': "mightn't",
    "mightnt've": "mightn't've", 'mightve': "might've", 'mustnt': "mustn't", 'mustve': "must've",
    'neednt': "needn't", 'notve': "not've", 'oclock': "o'clock", 'oughtnt': "oughtn't", "ow's'at": "'ow's'at",
    'shant': "shan't", "she'dve": "she'd've", "she's": "she's", "shed've": "she'd've", "shouldn'tve": "shouldn't've",
    'shouldnt': "shouldn't", "shouldnt've": "shouldn't've", 'shouldve': "should've", "somebody'd": 'somebodyd',
    "somebody'dve": "somebody'd've", "somebodyd've": "somebody'd've", 'somebodyll': "somebody'll",
    'somebodys': "somebody's", "someone'dve": "someone'd've", 'someoned': "someone'd", "someoned've": "someone'd've",
    'someonell': "someone'll", 'someones': "someone's", "something'dve": "something'd've",
    'somethingd': "something'd", "somethingd've": "something'd've", 'somethingll': "something'll", 'thats': "that's",
    "there'dve": "there'd've", 'thered': "there'd", "thered've": "there'd've", 'therere': "there're",
    'theres': "there's", "they'dve": "they'd've", 'theyd': "they'd", "theyd've": "they'd've", 'theyll': "they'll",
    'theyre': "they're", 'theyve': "they've", 'twas': "'twas", 'wasnt': "wasn't", "we'dve": "we'd've",
    "wed've": "we'd've", 'werent': "weren't", 'weve': "we've", 'whatll': "what'll", 'whatre': "what're",
    'whats': "what's", 'whatve': "what've", 'whens': "when's", 'whered': "where'd", 'wheres': "where's",
    'whereve': "where've", "who'dve": "who'd've", 'whod': "who'd", "whod've": "who'd've", 'wholl': "who'll",
    'whos': "who's", 'whove': "who've", 'whyll': "why'll", 'whyre': "why're", 'whys': "why's", 'wont': "won't",
    "wouldn'tve": "wouldn't've", 'wouldnt': "wouldn't", "wouldnt've": "wouldn't've", 'wouldve': "would've",
    "y'all'dve": "y'all'd've", "y'alld've": "y'all'd've", "y'allll": "y'all'll", 'yall': "y'all",
    "yall'd've": "y'all'd've", "yall'll": "y'all'll", "you'dve": "you'd've", 'youd': "you'd", "youd've": "you'd've",
    'youll': "you'll", 'youre': "you're", 'youve': "you've",
}


def _coin_substring(pred: str, answer: str) -> bool:
    return answer in pred or pred in answer


@register("coin_imagenet")
@register("coin_imagenet_official")
def coin_imagenet(pred: str, ref: dict[str, Any]) -> float:
    """eval_ImagetNet.py: the answer occurs in the prediction or the prediction in the answer (raw strings,
    case-sensitive). An empty prediction occurs in every answer and so counts right, as there (CoIN's
    published numbers count it); ``coin_imagenet_nonempty`` scores it 0. ``coin_imagenet_official`` is
    the same rule under its earlier name."""
    return float(_coin_substring(pred, ref["answer"]))


@register("coin_imagenet_nonempty")
def coin_imagenet_nonempty(pred: str, ref: dict[str, Any]) -> float:
    """``coin_imagenet`` with an empty prediction scored 0 (a named option: it departs from CoIN's numbers)."""
    return float(bool(pred) and _coin_substring(pred, ref["answer"]))


def coin_option_letter(pred: str) -> str:
    """eval_science_qa.py's answer parsing: the prediction itself if it is an option letter, the first
    character of "X. ...", else the first one-character word (upper-cased), else "FAILED"."""
    if pred in _SQA_OPTIONS:
        return pred
    if len(pred) >= 3 and pred[0] in _SQA_OPTIONS and pred[1:3] == ". ":
        return pred[0]
    words = re.findall(r"\b(\w)\b", pred)
    return words[0].upper() if words else "FAILED"


@register("coin_scienceqa")
def coin_scienceqa(pred: str, ref: dict[str, Any]) -> float:
    """eval_science_qa.py: the parsed letter must be one of the question's options (``num_choices`` in the
    meta, else all five) and equal the answer's letter ("The answer is B." scores 1; "I think B" scores 0,
    "I" being the first one-character word)."""
    n = int(ref.get("num_choices") or len(ref.get("choices") or _SQA_OPTIONS))
    letter = coin_option_letter(pred)
    gold = ref["answer"].strip()
    gold = gold[0] if gold[:1] in _SQA_OPTIONS and (len(gold) == 1 or not gold[1].isalnum()) else gold
    return float(letter in _SQA_OPTIONS[:n] and letter == gold)


@register("coin_vizwiz")
@register("coin_vqav2")
@register("ucit_accuracy")
def upper_equal(pred: str, ref: dict[str, Any]) -> float:
    """The prediction equals the single answer after upper(): CoIN's eval_vizwiz.py and eval_vqav2.py, and
    MCITlib's UCIT accuracy (Ghy0501/MCITlib 2956dfd, CL-MoE/llava/eval/CoIN/eval_deepseek_r1.py, for
    ImageNet-R, ArxivQA, IconQA, CLEVR-Math; its second number, a DeepSeek-judged similarity, needs that API
    and is not reproduced)."""
    return float(pred.upper() == ref["answer"].upper())


@register("coin_ocrvqa")
def coin_ocrvqa(pred: str, ref: dict[str, Any]) -> float:
    """eval_ocrvqa.py: a prediction containing "Unanswerable" scores 0 (whatever the answer); otherwise
    lower-cased equality with the answer."""
    if "Unanswerable" in pred:
        return 0.0
    return float(pred.lower() == ref["answer"].lower())


@register("coin_gqa")
def coin_gqa(pred: str, ref: dict[str, Any]) -> float:
    """convert_gqa_for_eval.py + eval_gqa.py's accuracy: the prediction without trailing full stops,
    lower-cased, equals the GQA answer."""
    return float(pred.rstrip(".").lower() == ref["answer"])


def evalai_normalise(text: str) -> str:
    """The m4c evaluator's EvalAIAnswerProcessor (CoIN's m4c_evaluator.py, from facebookresearch/mmf):
    lower case, commas and question marks dropped, "'s" split off, then the VQA evaluation's
    normalisation (``vqa_normalise``; its digit-comma-digit rule never fires here, the commas being gone)."""
    t = text.lower().replace(",", "").replace("?", "").replace("'s", " 's").strip()
    return vqa_normalise(_vqa_clean(t))


@register("coin_textvqa")
def coin_textvqa(pred: str, ref: dict[str, Any]) -> float:
    """eval_textvqa.py (m4c TextVQAAccuracyEvaluator): the normalised prediction's soft score among the
    normalised annotator answers, min(1, matches among the other nine / 3) averaged over leaving each of the
    ten out. ("1000" matches an annotator's "1,000"; "U.S.A." is "usa".)"""
    answers = [evalai_normalise(a) for a in ref.get("answers") or [ref["answer"]]]
    p = evalai_normalise(pred)
    return _soft_score(p, answers) if p in answers else 0.0


def coin_box(text: str, official: bool = True) -> list[float] | None:
    """A predicted box: four comma-separated floats, else None. eval_grounding.py removes every bracket and
    then cuts the first and last character (``[1:-1]``) before splitting on commas, as its model answers
    " x1, y1, x2, y2 " would need; so "[0.1, 0.2, 0.5, 0.6]" reads as y2 = 0.0 (scores 0 there) and
    "(0.1, 0.2, 0.5, 0.6)" reads right. ``official=False`` is the project's parser: the numbers inside the
    first brackets (the whole text if it has none), nothing cut."""
    if official:
        s = text.replace("[", "").replace("]", "")[1:-1]
    else:
        m = re.search(r"\[([^\[\]]*)\]", text)
        s = m.group(1) if m else text
    try:
        box = [float(x) for x in s.split(",")]
    except ValueError:
        return None
    return box if len(box) == 4 else None


def coin_iou(a: list[float], b: list[float]) -> float:
    """eval_grounding.calculate_iou: the union from the raw (possibly negative) areas."""
    inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0


def _coin_grounding(pred: str, ref: dict[str, Any], official: bool) -> float:
    box = coin_box(pred, official)
    gold = ref.get("box")
    if gold is None:
        text = ref["answer_bbox"] if "answer_bbox" in ref else ref["answer"]
        gold = [float(x) for x in str(text).replace("[", "").replace("]", "").split(",")]
    if box is None:
        return 0.0
    size = ref.get("size")
    if not size:
        raise ValueError("coin_grounding needs the image 'size' of each test record (CoIN's Grounding/test.json "
                         "has it); this sample has none")
    max_wh = max(size)
    return float(coin_iou([x * max_wh for x in box], [float(x) * max_wh for x in gold]) > 0.5)


@register("coin_grounding")
@register("coin_grounding_official")
def coin_grounding(pred: str, ref: dict[str, Any]) -> float:
    """eval_grounding.py exactly: the prediction parsed after its ``[1:-1]`` cut (``coin_box``), both boxes
    multiplied by max(width, height) of the record's ``size``, IoU > 0.5 (strictly). The scaling is not a
    no-op: at IoU one half its rounding decides (prediction [0.60, 0.13, 0.75, 0.80] against [0.55, 0.13, 0.70,
    0.80] in a 500x375 image scores 0 scaled, 1 unscaled). ``coin_grounding_official`` is the same rule under
    its earlier name; ``coin_grounding_parsed`` reads the box with the project's parser."""
    return _coin_grounding(pred, ref, official=True)


@register("coin_grounding_parsed")
def coin_grounding_parsed(pred: str, ref: dict[str, Any]) -> float:
    """``coin_grounding`` with the project's box parser (the numbers in the first brackets, nothing cut: a
    model answering "[x1, y1, x2, y2]" as CoIN trains it is read as written). A named option; it departs
    from CoIN's numbers wherever the cut changes the box."""
    return _coin_grounding(pred, ref, official=False)


# --------------------------------------------------------------------------------------------------
# MLLM-CL's evaluation scripts (bjzhb666/MLLM-CL 80bf389, ETrain/Eval/LLaVA/CoIN/eval_*.py; byte-identical in
# Ghy0501/MCITlib 2956dfd <method>/llava/eval/CoIN/), one scorer per rule: MLLM-DCL's RS and AD (eval_ai2d), Med
# (eval_pvqa), Sci (eval_sci), Fin (eval_finvis); MLLM-ACL's OCR (eval_ocr) and VP (eval_sat). Each returns the
# per-sample number the script adds to its count; the script's accuracy is their mean x 100. Their quirks are
# theirs and kept (a decimal answer without spaces never matches in eval_ai2d: it loses its dots, the prediction
# does not), as the published tables count them.


@register("mllm_cl_ai2d")
def mllm_cl_ai2d(pred: str, ref: dict[str, Any]) -> float:
    """eval_ai2d.py (MLLM-DCL RS and AD): a prediction containing "Unanswerable" scores 0; lower case; an
    answer with a space must occur in the prediction; a one-word answer loses its full stops and must occur
    in it (a prediction with spaces: after a space, or before a space, full stop or comma)."""
    if "Unanswerable" in pred:
        return 0.0
    p, gt = pred.lower(), ref["answer"].lower()
    if " " in gt:
        return float(gt in p)
    gt = gt.replace(".", "")
    if " " in p:
        return float(f" {gt}" in p or f"{gt} " in p or f"{gt}." in p or f"{gt}," in p)
    return float(gt in p)


@register("mllm_cl_pvqa")
def mllm_cl_pvqa(pred: str, ref: dict[str, Any]) -> float:
    """eval_pvqa.py (MLLM-DCL Med): "Unanswerable" scores 0; else the answer occurs in the prediction, case
    ignored ("no" occurs in "I do not know")."""
    if "Unanswerable" in pred:
        return 0.0
    return float(ref["answer"].lower() in pred.lower())


_SCI_EXACT = ("AI2D", "TQA", "VQA", "SciVerse")


@register("mllm_cl_sci")
def mllm_cl_sci(pred: str, ref: dict[str, Any]) -> float:
    """eval_sci.py (MLLM-DCL Sci): "Unanswerable" scores 0; an image whose file name starts "AI2D_", "TQA_",
    "VQA_" or "SciVerse_" needs the lower-cased prediction to equal the answer; the others (MapQA): a question
    containing "Which states" scores the share of the answer's comma-separated items among the prediction's
    (unstripped, so ", " costs an item), else the answer must occur in the prediction. Needs the record's
    ``image_name`` and ``question``."""
    if "Unanswerable" in pred:
        return 0.0
    p, gt = pred.lower(), ref["answer"].lower()
    if str(ref["image_name"]).split("/")[-1].split("_")[0] in _SCI_EXACT:
        return float(gt == p)
    if "Which states" in ref["question"]:
        items, said = gt.split(","), p.split(",")
        return sum(1 for g in items if g in said) / len(items)
    return float(gt in p)


@register("mllm_cl_finvis")
def mllm_cl_finvis(pred: str, ref: dict[str, Any]) -> float:
    """eval_finvis.py (MLLM-DCL Fin): "Unanswerable" scores 0; the prediction without spaces and full stops,
    lower-cased, equals the lower-cased answer ("A." and " a " score; "(A)" does not)."""
    if "Unanswerable" in pred:
        return 0.0
    return float(pred.lower().replace(" ", "").replace(".", "") == ref["answer"].lower())


OCRBENCH_CATEGORIES = ("Regular Text Recognition", "Irregular Text Recognition", "Artistic Text Recognition",
                       "Handwriting Recognition", "Digit String Recognition", "Non-Semantic Text Recognition",
                       "Scene Text-centric VQA", "Doc-oriented VQA", "Key Information Extraction",
                       "Handwritten Mathematical Expression Recognition")


@register("mllm_cl_ocrbench")
def mllm_cl_ocrbench(pred: str, ref: dict[str, Any]) -> float:
    """eval_ocr.py (MLLM-ACL OCR, OCRBench's rule): a hit when any reference answer occurs in the prediction,
    both stripped, newlines deleted (not spaced) and lower-cased; for "Handwritten Mathematical Expression
    Recognition" spaces are deleted too and case counts. The script's "Final Score Norm" is the hit count / 10,
    the mean x 100 at OCRBench's 1000 questions; the mean is reported here at any size. An ``answer_type``
    outside OCRBench's ten categories is refused (the script crashes on it, on a hit only)."""
    category = ref.get("answer_type")
    if category not in OCRBENCH_CATEGORIES:
        raise ValueError(f"mllm_cl_ocrbench: answer_type {category!r} is not one of OCRBench's categories")
    answers = ref.get("answers") or [ref["answer"]]
    if category == "Handwritten Mathematical Expression Recognition":
        p = pred.strip().replace(" ", "").replace("\n", "")
        return float(any(a.strip().replace(" ", "").replace("\n", "") in p for a in answers))
    p = pred.lower().strip().replace("\n", "")
    return float(any(a.lower().strip().replace("\n", "") in p for a in answers))


@register("mllm_cl_vp")
def mllm_cl_vp(pred: str, ref: dict[str, Any]) -> float:
    """eval_sat.py (MLLM-ACL VP): the answer, lower-cased and stripped of spaces, newlines and full stops,
    occurs in the prediction treated the same way ("(A) or (B)" scores for "(A)"; no "Unanswerable" rule).
    The script's second number, the accuracy on ``task == "Count"`` alone, divides by zero without such
    samples; it is not reproduced."""
    def squash(t: str) -> str:
        return t.lower().strip().replace(" ", "").replace("\n", "").replace(".", "")

    return float(squash(ref["answer"]) in squash(pred))
