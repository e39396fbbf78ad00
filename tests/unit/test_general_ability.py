"""The lmms-eval adapter (mcit.run.general_ability) answers lmms-eval's requests as the method answers its own
evaluation batches, for each family of methods (prompts, LoRA, mixtures of LoRA experts), in any batching; what
it cannot do (sampling, likelihoods, several images) is refused by name. The launched path (a finished run, a
local lmms-eval task, the report) is tests/launch/test_mcit_pipeline.py."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch

from mcit.run.general_ability import LmmsEvalError, make_adapter

SPLIT = "test"


@pytest.fixture(scope="module")
def count_questions(mcit_assets):
    from mcit.data.shards import iter_samples, open_split

    split = open_split(mcit_assets["shards"] / "count" / "test")
    return split, list(iter_samples(split, 0, 1, policy="sample"))[:7]


def _requests(samples, gen_kwargs):
    """lmms-eval's generate_until requests for ``samples`` (args: context, gen_kwargs, doc_to_visual, doc_id, task,
    split) and the task's docs: the question without "<image>", the image as a PIL image."""
    from PIL import Image

    from mcit.data.instructions import turns

    docs = []
    for s in samples:
        q, _ = turns(json.loads(s["json"])["conversations"], s["__key__"])[-1]
        docs.append({"question": q.replace("<image>\n", ""), "image": Image.open(io.BytesIO(s["png"]))})
    reqs = [SimpleNamespace(args=(d["question"], dict(gen_kwargs), lambda doc: [doc["image"]], n, "t", SPLIT))
            for n, d in enumerate(docs)]
    return reqs, {"t": {SPLIT: docs}}


def _trained(name, bb, params):
    """A freshly built method (seeded); the test trains it a few steps so its answers are its own."""
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence

    cls = METHODS.get(name)
    torch.manual_seed(0)
    m = cls(cls.Params(**params), bb, TaskSequence.from_label_spaces(["a", "b"], [[], []]))
    return m


@pytest.mark.parametrize("name,params", [("prompt_tuning", {"prompt_length": 2}),
                                         ("lora", {"r": 4, "alpha": 8}),
                                         ("moelora", {"r": 4, "experts": 2, "alpha": 8}),
                                         ("cl_moe", {"r": 8, "alpha": 16, "experts": 4, "dropout": 0.0,
                                                     "train_projector": False})])
def test_adapter_answers_as_the_method_does_in_any_batching(mcit_assets, count_questions, name, params):
    from mcit.models.mllm import MLLMBackbone

    split, samples = count_questions
    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))  # its own: the LoRA family injects its layers
    m = _trained(name, bb, params)
    train = bb.make_collate(split, 0, train=True)(samples)
    opt = torch.optim.Adam(m.trainable_parameters(), lr=0.01)  # moved, not yet one answer for every question
    for _ in range(3):
        opt.zero_grad()
        terms = m(train)
        (terms.per_sample.mean() + (terms.regularizer if terms.regularizer is not None else 0)).backward()
        opt.step()
    m.eval()
    with torch.no_grad():
        own = m.generate(bb.make_collate(split, 1, train=False)(samples), 3)
    host = SimpleNamespace(backbone=bb, method=m)
    reqs, docs = _requests(samples, {"max_new_tokens": 3, "until": ["\n\n"], "do_sample": False, "temperature": 0})
    answers = []
    for batch_size in (1, 3, 7):
        adapter = make_adapter(host, 1, batch_size, max_new_tokens=8)
        adapter.task_dict = docs
        answers.append(adapter.generate_until(reqs))
    assert answers[0] == answers[1] == answers[2] == own
    assert len(set(own)) > 1  # the answers differ between questions: the comparison sees each one


def test_adapter_cuts_at_stop_strings_and_refuses_what_it_cannot_do(mcit_assets, count_questions, llava_backbone):
    split, samples = count_questions
    m = _trained("prompt_tuning", llava_backbone, {"prompt_length": 2}).eval()
    host = SimpleNamespace(backbone=llava_backbone, method=m)
    adapter = make_adapter(host, 0, 4, max_new_tokens=4)
    reqs, docs = _requests(samples[:3], {"max_new_tokens": 4})
    adapter.task_dict = docs
    full = adapter.generate_until(reqs)
    cut = [a.split("o")[0] for a in full]
    assert cut != full, full  # some answer holds the stop string
    cut_reqs, _ = _requests(samples[:3], {"max_new_tokens": 4, "until": ["o"]})
    assert adapter.generate_until(cut_reqs) == cut
    with pytest.raises(LmmsEvalError, match="samples"):
        adapter.generate_until(_requests(samples[:1], {"do_sample": True})[0])
    with pytest.raises(LmmsEvalError, match="likelihoods"):
        adapter.loglikelihood(reqs)
    two = [SimpleNamespace(args=(r.args[0], {}, lambda doc: [doc["image"], doc["image"]], *r.args[3:])) for r in reqs]
    with pytest.raises(LmmsEvalError, match="2 images"):
        adapter.generate_until(two)


@pytest.fixture(scope="module")
def llava_backbone(mcit_assets):
    from mcit.models.mllm import MLLMBackbone

    return MLLMBackbone.from_path(str(mcit_assets["backbone"]))


def test_a_row_run_with_a_sample_limit_is_marked_in_the_report(tmp_path):
    """report.md marks every number answered on the first N questions only (``--lmms-limit``) and says N under the
    table; a full pass of the same task in another row is not marked."""
    from mcit.core import metrics as M

    where = tmp_path / "eval" / "general"
    where.mkdir(parents=True)
    (where / "zero_shot.json").write_text(json.dumps({
        "checkpoint": None, "tasks": ["mme"], "results": {"mme": {"acc": 0.5}}, "limits": {"mme": None}}))
    (where / "after_task_0.json").write_text(json.dumps({
        "checkpoint": 0, "tasks": ["mme", "grp"], "limits": {"mme": 10, "grp": None},
        "results": {"mme": {"acc": 0.4}, "grp": {"acc": 0.7}, "grp_a": {"acc": 0.6}},
        "cells": {"mme": {"names": ["mme"]}, "grp": {"names": ["grp", "grp_a"]}}}))
    (where / "after_task_1.json").write_text(json.dumps({  # a row from before the per-task limits
        "checkpoint": 1, "tasks": ["grp"], "limit": 5, "results": {"grp": {"acc": 0.65}, "grp_a": {"acc": 0.5}}}))
    limits = M.general_limits(tmp_path / "eval")
    assert limits == {"after_task_0": {"mme": 10}, "after_task_1": {"grp": 5}}
    text = M.general_markdown(M.general_rows(tmp_path / "eval"), limits)
    lines = {ln.split("|")[1].strip(): ln for ln in text.splitlines() if ln.startswith("| ") and "row" not in ln}
    assert "0.5 |" in lines["zero shot"] and "†" not in lines["zero shot"]
    assert "0.4 †" in lines["after task 0"] and "0.7 |" in lines["after task 0"]
    assert "0.65 †" in lines["after task 1"]
    assert "after task 0: mme (first 10); after task 1: grp (first 5)" in text
