"""SEFE's RegLoRA on the tiny LLaVA and on a tiny Llama: training steps over two tasks, what trains, the key
elements and the regulariser at the task boundary, the rebuild from the state, per-sample generation, where the
LoRA dropout applies. (Numbers against the official code: tests/reference/test_sefe_reference.py.)"""

from __future__ import annotations

import pytest
import torch

SMALL = {"r": 4, "alpha": 8, "train_projector": False}


@pytest.fixture(scope="module")
def llava(mcit_assets):
    from mcit.data.shards import iter_samples, open_split
    from mcit.models.mllm import MLLMBackbone

    bb = MLLMBackbone.from_path(str(mcit_assets["backbone"]))  # its own: the method injects its own layers
    split = open_split(mcit_assets["shards"] / "count" / "test")
    samples = list(iter_samples(split, 0, 1, policy="sample"))[:8]
    return bb, split, samples


def _sefe(bb, tasks: int = 2, seed: int = 0, **params):
    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence

    cls = METHODS.get("sefe")
    torch.manual_seed(seed)
    seq = TaskSequence.from_label_spaces([f"t{i}" for i in range(tasks)], [[] for _ in range(tasks)])
    return cls(cls.Params(**{**SMALL, **params}), bb, seq)


def _step(m, batch, opt) -> dict:
    opt.zero_grad()
    terms = m(batch)
    loss = terms.per_sample.mean() + (terms.regularizer if terms.regularizer is not None else 0)
    loss.backward()
    opt.step()
    return terms


def test_sefe_trains_two_tasks_on_the_tiny_llava_and_regularises_the_second(llava):
    """Task 0 starts as the pre-trained model (B = 0) and trains without a regulariser; task 1 trains only its own
    pair, against the key elements of task 0's (int(0.02 rows cols) per matrix): zero while its B is zero, positive
    after a step. A rebuild that loads the state computes the same loss and finds the same key elements."""
    bb, split, samples = llava
    batch = bb.make_collate(split, 0, train=True)(samples[:4])
    m = _sefe(bb).eval()  # eval: no dropout, so losses compare exactly
    with torch.no_grad(), m.zero_shot():
        pretrained = m(batch).per_sample
    assert len(m.stacks()) == 7 * bb.language_model.config.num_hidden_layers  # every linear layer of the LLM
    m.set_task(0)
    m.before_task(0)
    opt = torch.optim.Adam(m.trainable_parameters(), lr=0.01)
    terms = _step(m, batch, opt)
    assert terms.regularizer is None and torch.equal(terms.per_sample.detach(), pretrained)
    for _ in range(2):
        _step(m, batch, opt)
    m.after_task(0)
    with torch.no_grad():
        trained = m(batch).per_sample
    assert not torch.allclose(trained, pretrained)

    m.set_task(1)
    m.before_task(1)
    mine = {id(p) for p in m.trainable_parameters()}
    assert mine == {id(p) for n, p in m.named_parameters() if n.endswith((".A1", ".B1"))}
    assert all(p.requires_grad == (id(p) in mine) for p in m.parameters())
    keys = m.key_elements()
    for name, s in m.stacks().items():
        rows, cols = s.b(0).shape[0], s.a(0).shape[1]
        assert keys[name].shape == (int(0.02 * rows * cols), 2) and len(set(map(tuple, keys[name].tolist()))) == \
            keys[name].shape[0]
        top = s.delta(0).abs()
        assert top[keys[name][:, 0], keys[name][:, 1]].min() >= top.flatten().kthvalue(top.numel() - len(keys[name]))[0]
    opt = torch.optim.Adam(m.trainable_parameters(), lr=0.01)
    terms = _step(m, batch, opt)
    assert float(terms.regularizer.detach()) == 0 and terms.logs["reg_loss"] == 0  # B1 = 0: nothing changed yet
    assert torch.equal(terms.per_sample.detach(), trained)
    terms = _step(m, batch, opt)
    reg = terms.logs["reg_loss"]
    assert reg > 0 and float(terms.regularizer.detach()) == pytest.approx(2.5e3 * reg)
    with torch.no_grad():
        assert not m(batch).regularizer  # no gradients: no regulariser (the training-interference loss)

    again = _sefe(bb, seed=1).eval()  # another initialisation: the loaded state replaces all of it
    assert set(again.state_dict()) == set(m.state_dict())  # the key elements are no state of their own
    again.load_state_dict(m.state_dict())
    for task in (0, 1):
        m.set_task(task)
        again.set_task(task)
        with torch.no_grad():
            assert torch.equal(again(batch).per_sample, m(batch).per_sample)
    assert all(torch.equal(again.key_elements()[n], k) for n, k in keys.items())


def test_sefe_generation_does_not_depend_on_the_batch(llava):
    bb, split, samples = llava
    m = _sefe(bb).eval()
    with torch.no_grad():  # both tasks' pairs nonzero, as after training two tasks
        for s in m.stacks().values():
            for i in (0, 1):
                s.b(i).normal_(0, 0.02)
    m.set_task(1)
    collate = bb.make_collate(split, 0, train=False)
    together = m.generate(collate(samples), 4)
    assert together == [m.generate(collate([s]), 4)[0] for s in samples]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaModel

    class Holder:
        task_type = "generation"

        def __init__(self, lm) -> None:
            self.language_model = lm
            self.num_layers = lm.config.num_hidden_layers

    torch.manual_seed(0)
    return Holder(LlamaModel(LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=24, vocab_size=32)))


def test_sefe_dropout_reaches_only_the_current_pair():
    """The earlier tasks' pairs are merged weights in the official code: they see the input without the LoRA
    dropout, the current pair with it."""
    m = _sefe(_tiny_llama(), dropout=0.5)
    s = m.stacks()["layers.0.self_attn.q_proj"]
    x = torch.randn(3, 5, 16)
    m.set_task(1)
    with torch.no_grad():
        s.b(0).normal_()
        m.train()
        noisy = s(x)
        m.eval()
        assert torch.equal(noisy, s(x))  # B1 = 0: only the merged pair, no dropout
        s.b(1).normal_()
        clean = s(x)
        m.train()
        assert not torch.allclose(s(x), clean)


def test_sefe_normaliser_and_key_ratio():
    """``reg_normalizer: null`` is the mean over the adapted matrices (224 on Vicuna-7B, where the official constant
    is that mean); a key_ratio that leaves a matrix without key elements is refused at the build."""
    m = _sefe(_tiny_llama(), reg_normalizer=None)
    m.set_task(1)
    with torch.no_grad():
        for s in m.stacks().values():
            s.b(0).normal_()
            s.b(1).normal_()
    x = torch.randn(2, 4, 16)
    m.backbone.language_model(inputs_embeds=x)
    terms = [s.term for s in m.stacks().values()]
    assert len(terms) == 7 and all(t > 0 for t in terms)
    assert torch.allclose(m.regularizer(), sum(terms) / 7)
    m.backbone.language_model(inputs_embeds=x)
    m.params = m.params.model_copy(update={"reg_normalizer": 224.0})
    assert torch.allclose(m.regularizer(), sum(terms) / 224)
    with pytest.raises(ValueError, match="key_ratio"):
        _sefe(_tiny_llama(), key_ratio=0.001)  # int(0.001 * 16 * 16) = 0


# -- Answer Style Diversification (data_prep.answer_styles) ---------------------------------------------------
def _stub_reply(calls: list[str]):
    """A rewriter that answers each official prompt with the JSON its style asks for (with the trailing commas the
    official templates show), recording the prompts."""
    def reply(model: str, prompt: str, sample: dict, max_new_tokens: int) -> str:
        calls.append(prompt)
        if "three plausible" in prompt:
            return '```json\n{"distractor_options": ["dozens", "none", "many",],}\n```'
        if "a plausible but incorrect distractor option" in prompt:
            return 'Sure: {"distractor_option": "dozens",}'
        style = "detailed" if "comprehensive and detailed" in prompt else "brief"
        return '{"explanation": "a %s reason",}' % style

    return reply


def _records(split_dir) -> list[tuple[str, dict, bytes]]:
    import json

    from mcit.data.shards import iter_samples, open_split

    return [(s["__key__"], json.loads(s["json"]), s["png"])
            for s in iter_samples(open_split(split_dir), 0, 1, policy="sample")]


def test_answer_styles_rewrite_the_planned_samples_into_each_style(mcit_assets, monkeypatch, tmp_path):
    """round(ratio * N) samples, the styles in turn, each rewritten from the model's JSON (mcq: four lettered
    options, yn: a candidate and yes/no, brief / detail: the answer and its explanation); the other samples and
    every image unchanged; the manifest keeps the task's kind and scorer; the same seed gives the same bytes."""
    from data_prep import answer_styles as A

    calls: list[str] = []
    monkeypatch.setattr(A, "rewrite", _stub_reply(calls))
    src = mcit_assets["shards"] / "count" / "train"
    args = ["--in", str(src), "--model", str(mcit_assets["backbone"]), "--ratio", "0.5", "--shard-size", "16",
            "--no-progress"]
    assert A.main([*args, "--out", str(tmp_path / "a")]) == 0
    original = {k: (r, png) for k, r, png in _records(src)}
    out = _records(tmp_path / "a")
    assert [k for k, _, _ in out] == list(original) and len(out) == 48 and len(calls) == 24
    seen = {s: 0 for s in A.STYLES}
    for key, rec, png in out:
        before, image = original[key]
        assert png == image
        if "asd" not in rec:
            assert rec == before
            continue
        style = rec["asd"]["style"]
        seen[style] += 1
        assert rec["asd"]["rewritten"]
        q, a = rec["conversations"][-2]["value"], rec["conversations"][-1]["value"]
        answer = before["conversations"][-1]["value"]
        asked = before["conversations"][-2]["value"]
        assert asked.startswith("<image>\n") and q.startswith(asked + "\n") and rec["answers"] == [a]
        if style == "mcq":
            assert sorted(rec["choices"]) == sorted([answer, "dozens", "none", "many"])
            assert rec["choices"][A.LETTERS.index(a)] == answer
            assert q.endswith("Answer with the option's letter from the given choices directly.")
        elif style == "yn":
            assert a in ("Yes", "No") and (f'"{answer}"' in q) == (a == "Yes")
        else:
            assert a == f"{answer}. a {'detailed' if style == 'detail' else 'brief'} reason"
    assert seen == {s: 6 for s in A.STYLES}
    manifest = __import__("json").loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["kind"] == "instruction" and manifest["scorer"] == "exact_match" and manifest["task"] == "count"
    assert manifest["answer_styles"]["planned"] == {s: 6 for s in A.STYLES}
    assert A.main([*args, "--out", str(tmp_path / "b")]) == 0
    assert _records(tmp_path / "b") == out
    assert A.main([*args, "--out", str(tmp_path / "c"), "--seed", "1"]) == 0
    assert [r.get("asd") for _, r, _ in _records(tmp_path / "c")] != [r.get("asd") for _, r, _ in out]


def test_answer_styles_resume_after_an_interruption(mcit_assets, monkeypatch, tmp_path):
    """An interrupted run keeps its finished shards: the re-run asks the model only about the rest and writes what
    an uninterrupted run writes."""
    from data_prep import answer_styles as A

    src = mcit_assets["shards"] / "count" / "train"
    args = ["--in", str(src), "--model", str(mcit_assets["backbone"]), "--ratio", "1.0", "--shard-size", "16",
            "--no-progress"]
    calls: list[str] = []
    stub = _stub_reply(calls)

    def failing(*a, **k):
        if len(calls) == 20:  # in the second shard
            raise KeyboardInterrupt
        return stub(*a, **k)

    monkeypatch.setattr(A, "rewrite", failing)
    with pytest.raises(KeyboardInterrupt):
        A.main([*args, "--out", str(tmp_path / "x")])
    monkeypatch.setattr(A, "rewrite", stub)
    calls.clear()
    assert A.main([*args, "--out", str(tmp_path / "x")]) == 0
    assert len(calls) == 32  # shards 2 and 3
    assert A.main([*args, "--out", str(tmp_path / "y")]) == 0
    assert _records(tmp_path / "x") == _records(tmp_path / "y")


def test_answer_styles_with_the_tiny_llava_keep_a_sample_the_reply_cannot_rewrite(mcit_assets, tmp_path):
    """The real rewriter: the tiny LLaVA answers the official prompts (it was never taught JSON), so the samples
    it was asked about stay as they were and say so; the split verifies."""
    from data_prep import answer_styles as A

    out = tmp_path / "asd"
    assert A.main(["--in", str(mcit_assets["shards"] / "colour" / "train"), "--out", str(out), "--model",
                   str(mcit_assets["backbone"]), "--ratio", "0.1", "--max-new-tokens", "6", "--no-progress"]) == 0
    recs = [r for _, r, _ in _records(out)]
    asked = [r for r in recs if "asd" in r]
    assert len(asked) == 5 and not any(r["asd"]["rewritten"] for r in asked)
    assert A.main(["--verify", str(out)]) == 0


def test_answer_styles_parse_replies_and_refuse_bad_settings(mcit_assets, tmp_path):
    from data_prep import answer_styles as A
    from mcit.data.shards import DataError

    assert A.parse("mcq", '[{"question_index": 1, "distractor_options": ["a", "b", "c"],},]')["distractor_options"]
    assert A.parse("yn", "no json here") is None and A.parse("brief", '{"explanation": ""}') is None
    assert A.parse("mcq", '{"distractor_options": ["a", "b"]}') is None
    assert A.rewritten("mcq", "Q?", "a", {"distractor_options": ["A", "b", "c"]}, A.sample_rng(0, "k")) is None
    assert A.fill("<question_list>", "Q?", "a") == "1. Question: Q?\n   Answer: a"
    with pytest.raises(DataError, match="ratio"):
        A.convert(mcit_assets["shards"] / "count" / "train", tmp_path / "o", model=mcit_assets["backbone"], ratio=2)
