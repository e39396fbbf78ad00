"""What each benchmark's official evaluation script does to a test question before it generates.

The official scripts read the test file's ``text`` and, for some tasks, add an instruction at inference time:
MLLM-DCL Med appends a one-word instruction, Fin a yes/no or a letter instruction depending on the answer, MLLM-ACL
OCR joins the image token with a space. The converters apply the same rule to the test split (the shards then hold
the question as the official model saw it; ``manifest.json`` names the rule and its source), so exact-match scores
can be compared with the published ones. Every shipped task has a row here, with the script and lines it comes
from (the repositories at the commits named; MCITlib's method folders share these files).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

IMAGE = "<image>"
COIN = "zackschen/CoIN e045ab8"
MCITLIB = "Ghy0501/MCITlib 2956dfd"
MLLM_CL = "bjzhb666/MLLM-CL 80bf389"


@dataclass(frozen=True)
class InferencePrompt:
    """One task's rule: ``suffix`` appended to the question (``yes_no_suffix`` instead where the answer is exactly
    'Yes' or 'No'), the image token joined to the question by ``image_sep``, ``image_first``: every image token taken
    out of the text and put first (CoIN's ScienceQA)."""

    source: str
    suffix: str = ""
    yes_no_suffix: str | None = None
    image_sep: str = "\n"
    image_first: bool = False

    def apply(self, question: str, answer: str) -> str:
        """The question as the official script hands it to the chat template (``<image>`` first where it has one)."""
        suffix = self.yes_no_suffix if self.yes_no_suffix is not None and answer in ("Yes", "No") else self.suffix
        if self.image_first and IMAGE in question:
            return f"{IMAGE}{self.image_sep}{question.replace(IMAGE, '').strip()}{suffix}"
        if question.startswith(IMAGE + "\n"):
            return f"{IMAGE}{self.image_sep}{question[len(IMAGE) + 1:]}{suffix}"
        return question + suffix

    def record(self) -> dict:
        """What the manifest keeps (``inference_prompt``)."""
        return {k: v for k, v in asdict(self).items() if v not in (None, "", False) or k == "source"}


AS_IS = "qs = line['text'] (nothing added)"
PVQA = " Answer the question with a single word (or phrase)."
FIN_YES_NO = " Only answer with yes or no directly."
FIN_LETTER = " Answer with the given letter directly, e.g., A, B, C, D."

OFFICIAL: dict[tuple[str, str], InferencePrompt] = {
    # CoIN: scripts/CoIN/Eval/<k>_eval_<task>.sh -> llava/eval/CoIN/<module>.py
    ("coin", "scienceqa"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_vqa_science.py L44, L55: the text without "
                                           f"<image>, stripped, <image>\\n first; --single-pred-prompt not passed "
                                           f"(1_eval_sqa.sh)", image_first=True),
    ("coin", "textvqa"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_text_vqa.py L42-46: {AS_IS}"),
    ("coin", "imagenet"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_vqa_cc_instruction.py L49-54: {AS_IS}"),
    ("coin", "gqa"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_gqa.py L42-46: {AS_IS}"),
    ("coin", "vizwiz"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_vizwiz.py L42-46: {AS_IS}"),
    ("coin", "grounding"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_vqa_cc_instruction.py L49-54: {AS_IS}"),
    ("coin", "vqav2"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_vqa_cc_instruction.py L49-54: {AS_IS}"),
    ("coin", "ocrvqa"): InferencePrompt(f"{COIN} llava/eval/CoIN/model_ocr_vqa.py L42-46: {AS_IS}"),
    # UCIT: MCITlib LoRA-FT/scripts/CoIN/Eval_UCIT/eval_<task>.sh -> llava/eval/CoIN/model_others.py
    **{("ucit", t): InferencePrompt(f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_others.py L49-55: {AS_IS}")
       for t in ("imagenet_r", "arxivqa", "vizwiz_caption", "iconqa", "clevr_math", "flickr30k")},
    # MLLM-DCL: MCITlib LoRA-FT/scripts/CoIN/Eval_MLLM_DCL/eval_<task>.sh (MLLM-CL scripts/LLaVA/Eval_dom/*.sh)
    **{("mllm_dcl", t): InferencePrompt(f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_ai2d.py L43-47 (MLLM-CL's L42-46): "
                                        f"{AS_IS}") for t in ("rs", "ad", "sci")},
    ("mllm_dcl", "med"): InferencePrompt(f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_pvqa.py L43 (eval_med.sh; "
                                         f"MLLM-CL's model_pvqa.py L42, which its 2_eval_medical.sh runs for the "
                                         f"zero-shot model only)", suffix=PVQA),
    ("mllm_dcl", "fin"): InferencePrompt(f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_fin.py L43-47 (MLLM-CL's L42-46): "
                                         f"'Yes' / 'No' answers get the yes/no instruction, every other the letter "
                                         f"one", suffix=FIN_LETTER, yes_no_suffix=FIN_YES_NO),
    # MLLM-ACL: MLLM-CL scripts/LLaVA/Eval_ability/*.sh -> ETrain/Eval/LLaVA/CoIN/<module>.py
    ("mllm_acl", "ocr"): InferencePrompt(f"{MLLM_CL} ETrain/Eval/LLaVA/CoIN/model_ocr.py L42-47: nothing added (its "
                                         f"suffix line is commented out), the image token joined with a space",
                                         image_sep=" "),
    ("mllm_acl", "math"): InferencePrompt(f"{MLLM_CL} ETrain/Eval/LLaVA/CoIN/model_math.py L42-46: {AS_IS}"),
    ("mllm_acl", "vp"): InferencePrompt(f"{MLLM_CL} ETrain/Eval/LLaVA/CoIN/model_sat.py L42-46: {AS_IS}"),
}


# The generation cap each official evaluation script decodes with (greedy: temperature 0, num_beams 1 everywhere);
# no official shell script passes --max_new_tokens, so a parser default counts as much as a hard-coded value.
# MCITlib's UCIT cap is its method folder's model_others.py: 256 in LoRA-FT, MoELoRA, OLoRA, HiDe, DISCO and CL-MoE
# (the baselines without a folder of their own, EWC, LwF, Replay and Fwd-Prompt, take LoRA-FT's scripts).
_COIN_DL = "parser default --max_new_tokens 128 (L139)"
_COIN_ITEM = "max_new_tokens=1024 hard-coded"
MAX_NEW_TOKENS: dict[tuple[str, str], tuple[int, str]] = {
    ("coin", "scienceqa"): (1024, f"{COIN} llava/eval/CoIN/model_vqa_science.py L81: {_COIN_ITEM}"),
    ("coin", "textvqa"): (128, f"{COIN} llava/eval/CoIN/model_text_vqa.py: {_COIN_DL}"),
    ("coin", "imagenet"): (1024, f"{COIN} llava/eval/CoIN/model_vqa_cc_instruction.py L79: {_COIN_ITEM}"),
    ("coin", "gqa"): (128, f"{COIN} llava/eval/CoIN/model_gqa.py: {_COIN_DL}"),
    ("coin", "vizwiz"): (128, f"{COIN} llava/eval/CoIN/model_vizwiz.py: {_COIN_DL}"),
    ("coin", "grounding"): (1024, f"{COIN} llava/eval/CoIN/model_vqa_cc_instruction.py L79: {_COIN_ITEM}"),
    ("coin", "vqav2"): (1024, f"{COIN} llava/eval/CoIN/model_vqa_cc_instruction.py L79: {_COIN_ITEM}"),
    ("coin", "ocrvqa"): (128, f"{COIN} llava/eval/CoIN/model_ocr_vqa.py: {_COIN_DL}"),
    **{("ucit", t): (256, f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_others.py L80: max_new_tokens=256 hard-coded")
       for t in ("imagenet_r", "arxivqa", "vizwiz_caption", "iconqa", "clevr_math", "flickr30k")},
    ("mllm_dcl", "rs"): (128, f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_ai2d.py L145: parser default"),
    ("mllm_dcl", "med"): (128, f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_pvqa.py L146: parser default"),
    ("mllm_dcl", "ad"): (128, f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_ai2d.py L145: parser default"),
    ("mllm_dcl", "sci"): (128, f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_ai2d.py L145: parser default"),
    ("mllm_dcl", "fin"): (128, f"{MCITLIB} LoRA-FT/llava/eval/CoIN/model_fin.py L149: parser default"),
    ("mllm_acl", "ocr"): (2048, f"{MLLM_CL} ETrain/Eval/LLaVA/CoIN/model_ocr.py L114-123: hard-coded"),
    ("mllm_acl", "math"): (2048, f"{MLLM_CL} ETrain/Eval/LLaVA/CoIN/model_math.py L153: parser default"),
    ("mllm_acl", "vp"): (64, f"{MLLM_CL} ETrain/Eval/LLaVA/CoIN/model_sat.py L144: parser default"),
}
# a method folder whose script decodes with another cap than LoRA-FT's
METHOD_MAX_NEW_TOKENS: dict[tuple[str, str], tuple[int, str]] = {
    ("ucit", "modal_prompt"): (128, f"{MCITLIB} ModalPrompt/llava/eval/ModalPrompt/model_others.py L83"),
    ("ucit", "sefe"): (1024, f"{MCITLIB} SEFE/llava/eval/CoIN/model_others.py L72"),
}


def official_max_new_tokens(benchmark: str, task: str, method: str) -> int:
    """The generation cap ``method``'s official evaluation of ``task`` uses (KeyError: a task not recorded)."""
    if (benchmark, method) in METHOD_MAX_NEW_TOKENS:
        return METHOD_MAX_NEW_TOKENS[(benchmark, method)][0]
    try:
        return MAX_NEW_TOKENS[(benchmark, task)][0]
    except KeyError:
        raise KeyError(f"no official generation cap recorded for {benchmark} task {task!r} "
                       f"(data_prep/inference_prompts.py)") from None


def official(benchmark: str, task: str) -> InferencePrompt:
    """The rule of a shipped task (KeyError names a task the table misses)."""
    try:
        return OFFICIAL[(benchmark, task)]
    except KeyError:
        raise KeyError(f"no official inference prompt recorded for {benchmark} task {task!r} "
                       f"(data_prep/inference_prompts.py)") from None


def apply_to_specs(specs: list[tuple], rule: InferencePrompt) -> list[tuple]:
    """The test split's shard specs with each sample's first question rewritten by ``rule``."""
    out = []
    for key, rid, source, image, ref in specs:
        conv = [dict(m) for m in ref["conversations"]]
        conv[0]["value"] = rule.apply(conv[0]["value"], conv[1]["value"] if len(conv) > 1 else "")
        out.append((key, rid, source, image, {**ref, "conversations": conv}))
    return out
