"""Judge-based scorers: a task whose answers a language model reads before they are scored (MLLM-ACL Math).

MLLM-CL scores its Math ability (MathVista's testmini) with a copy of VLMEvalKit's MathVista evaluation
(bjzhb666/MLLM-CL 80bf389, ETrain/Eval/LLaVA/CoIN/eval_math.py): each prediction is first read by rule
(``prefetch``: an option letter or option text for a multiple-choice question, ``int()`` / ``float()`` of the
whole prediction otherwise, kept only when it equals the answer); where the rule gives nothing, a judge model is
asked to extract the answer (``prompt``: five worked examples, the question, the response) and its reply is
scored by the same rule (``hit``). MLLM-CL asks gpt-4o-mini; here the judge is a local causal language model
(``eval.judge.path``, a transformers directory), greedy, ``eval.judge.max_new_tokens`` (128 as there) tokens, the
prompt as one user turn of its chat template when it has one. MLLM-CL retries a judge call that failed at the
API with a rising temperature; a local model does not fail, so the first greedy answer is the judge's.

What the rules compare is theirs, quirks kept: a multiple-choice letter must be upper case; ``int("14.0")``
fails, so "14.0" is wrong for an integer answer; floats compare exactly; a "list" or "text" answer never scores
(its comparison is ``str(None) == str(answer)``); a right answer of 0 is falsy, so the judge is asked anyway.
The judge runs on rank 0 over every gathered answer (``score_rows``).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable

# ------------------------------------------------------------------------------------------------------------------
# MathVista's rules (eval_math.py: list_to_dict, can_infer, can_infer_option, can_infer_text, post_check)

_REJECT = ("Sorry, I can't help with images of people yet.", "I can't process this file.",
           "I'm sorry, but without the image provided", "Cannot determine the answer")


def option_map(choices: Any) -> dict[str, str]:
    """{"A": first choice, ...}; ``choices`` as the table holds it (a Python list, or its repr)."""
    if isinstance(choices, str):
        choices = ast.literal_eval(choices)
    return {chr(65 + i): v for i, v in enumerate(choices or [])}


def infer_option(answer: str, choices: dict[str, Any]) -> str | bool:
    """can_infer_option: "Z" for a refusal; the one option letter standing alone among the words (after
    ``.()[],:;!*#{}`` become spaces), "Z" when none and a lone "Z" is there, else False."""
    if "Failed to obtain answer via API" in answer:
        return False
    if any(err in answer for err in _REJECT):
        return "Z"
    mod = answer
    for c in ".()[],:;!*#{}":
        mod = mod.replace(c, " ")
    splits = [x.strip() for x in mod.split()]
    count = sum(1 for c in choices if c in splits)
    if count == 1:
        for ch in choices:
            if ch in splits:
                return ch
    elif count == 0 and sum(1 for c in ("Z", "") if c in splits) == 1:
        return "Z"
    return False


def infer_text(answer: str, choices: dict[str, Any]) -> str | bool:
    """can_infer_text: the one option whose lower-cased text occurs in the lower-cased answer, else False."""
    answer = answer.lower()
    cands = [k for k, v in choices.items() if str(v).lower() in answer]
    return cands[0] if len(cands) == 1 else False


def infer(answer: Any, choices: dict[str, Any]) -> str | bool:
    answer = str(answer)
    return infer_option(answer, choices) or infer_text(answer, choices)


def _read(response: Any, ref: dict[str, Any]) -> tuple[Any, Any]:
    """post_check's (res, ans): the response read by the question's rule and the answer it is compared with."""
    res, ans = None, ref["answer"]
    try:
        if ref["question_type"] == "multi_choice":
            return infer(response, option_map(ref["choices"])), ref["answer_option"]
        if ref["answer_type"] == "integer":
            res = int(response)
            ans = int(ref["answer"])
        elif ref["answer_type"] == "float":
            res = float(response)
            ans = float(ref["answer"])
        else:
            res, ans = str(res), str(ans)
    except ValueError:
        pass
    return res, ans


def prefetch(prediction: str, ref: dict[str, Any]) -> Any:
    """post_check(prefetch=True): a multiple-choice question's inferred letter (right or wrong, False if none);
    otherwise the read value when it equals the answer, else False. A truthy result needs no judge."""
    res, ans = _read(prediction, ref)
    if ref["question_type"] == "multi_choice":
        return res
    return res if res == ans else False


def hit(res: Any, ref: dict[str, Any]) -> bool:
    """post_check(prefetch=False): the prefetched value or the judge's reply, read by the rule, equals the
    answer."""
    got, ans = _read(res, ref)
    return got == ans


ICE = (
    "\nHint: Please answer the question requiring an integer answer and provide the final value,\ne.g., 1, 2, 3, at "
    "the end.\n\nQuestion: Which number is missing?\n\nModel response: The number missing in the sequence is 14.\n"
    "\nExtracted answer: 14\n",
    "\nHint: Please answer the question requiring a floating-point number with one decimal place and provide the "
    "final value,\ne.g., 1.2, 1.3, 1.4, at the end.\n\nQuestion: What is the fraction of females facing the camera?"
    "\n\nModel response: The fraction of females facing the camera is 0.6,\nwhich means that six out of ten females "
    "in the group are facing the camera.\n\nExtracted answer: 0.6\n",
    "\nHint: Please answer the question requiring a floating-point number with two decimal places and provide the "
    "final value,\ne.g., 1.23, 1.34, 1.45, at the end.\n\nQuestion: How much money does Luca need to buy a sour "
    "apple candy and a butter-scotch candy? (Unit: $)\n\nModel response: Luca needs $1.45 to buy a sour apple candy "
    "and a butterscotch candy.\n\nExtracted answer: 1.45\n",
    "\nHint: Please answer the question requiring a Python list as an answer and provide the final list,\ne.g., "
    "[1, 2, 3], [1.2, 1.3, 1.4], at the end.\n\nQuestion: Between which two years does the line graph saw its "
    "maximum peak?\n\nModel response: The line graph saw its maximum peak between 2007 and 2008.\n\nExtracted "
    "answer: [2007, 2008]\n",
    "\nHint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.\n\n"
    "Question: What fraction of the shape is blue?\n\nChoices: (A) 3/11 (B) 8/11 (C) 6/11 (D) 3/5\n\nModel "
    "response: The correct answer is (B) 8/11.\n\nExtracted answer: B\n",
)
_TASK = ("\nPlease read the following example.\nThen extract the answer from the model response and type it at the "
         "end of the prompt.\n\n")


def prompt(prediction: str, ref: dict[str, Any]) -> str:
    """build_mathvista_gpt4_prompt: the task, the five examples, the table's question, the response (its
    "respone" and the missing newline before "Extracted answer:" are the original's)."""
    return _TASK + "".join(e + "\n" for e in ICE) + ref["judge_question"] + "\n" + "Model respone: " + \
        str(prediction) + "Extracted answer:"


# ------------------------------------------------------------------------------------------------------------------
# The judge and the judged scorers

Generate = Callable[[list[str]], list[str]]


@dataclass
class Judged:
    """A judged scorer: ``prefetch(prediction, ref)`` (truthy: no judge needed), ``prompt(prediction, ref)``,
    ``hit(res, ref)``; the reference fields it needs (``needs``)."""

    prefetch: Callable[[str, dict[str, Any]], Any]
    prompt: Callable[[str, dict[str, Any]], str]
    hit: Callable[[Any, dict[str, Any]], bool]
    needs: tuple[str, ...]


JUDGED: dict[str, Judged] = {
    "mllm_cl_math": Judged(prefetch, prompt, hit, ("judge_question", "question_type", "answer_type", "answer_option",
                                                     "choices")),
}


def score_rows(name: str, rows: list[dict[str, Any]], generate: Generate) -> list[dict[str, Any]]:
    """Per row (``prediction``, ``reference``): {"score", "judge_log", "judge_response"} as MathVista_auxeval and
    MathVista_acc give them; ``generate`` answers the prompts of the rows no rule could read, in one call."""
    spec = JUDGED[name]
    pre = [spec.prefetch(r["prediction"], r["reference"]) for r in rows]
    ask = [i for i, p in enumerate(pre) if not p]
    replies = dict(zip(ask, generate([spec.prompt(rows[i]["prediction"], rows[i]["reference"]) for i in ask])
                       if ask else []))
    out = []
    for i, r in enumerate(rows):
        res = pre[i] if i not in replies else replies[i]
        out.append({"score": float(spec.hit(res, r["reference"])),
                    "judge_log": "Succeed" if i in replies else "Prefetch succeed",
                    "judge_response": replies.get(i)})
    return out


class LocalJudge:
    """A local causal language model (a transformers directory) answering judge prompts greedily, in batches."""

    def __init__(self, path: str, max_new_tokens: int = 128, batch_size: int = 8) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size

    def text(self, prompt_: str) -> str:
        """The prompt as the judge reads it: one user turn of its chat template, or as it is without one."""
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template([{"role": "user", "content": prompt_}], tokenize=False,
                                                add_generation_prompt=True)
        return prompt_

    def __call__(self, prompts: list[str]) -> list[str]:
        import torch

        out: list[str] = []
        for i in range(0, len(prompts), self.batch_size):
            enc = self.tok([self.text(p) for p in prompts[i:i + self.batch_size]], return_tensors="pt",
                           padding=True, add_special_tokens=not getattr(self.tok, "chat_template", None))
            with torch.no_grad():
                gen = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                          pad_token_id=self.tok.pad_token_id)
            out += [t.strip() for t in self.tok.batch_decode(gen[:, enc["input_ids"].shape[1]:],
                                                             skip_special_tokens=True)]
        return out
