"""Converted datasets train through the pipeline (one launched process each)."""

from __future__ import annotations

import json

from conftest import launch, mcit_config, tiny_config
from raw_formats import cifar_raw, convert, convert_instruction_sets, cub_raw, domainnet_raw, imagenet_r_raw


def _train(assets, tmp_path, root, name, tasks):
    data = {"tasks": tasks, **({"root": str(root)} if root else {})}
    cfg = tiny_config(assets, tmp_path, name, data=data,
                      train={"epochs": 1, "deepspeed_config": "deepspeed_configs/cpu.json"})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads((tmp_path / "runs" / name / "metrics.json").read_text())
    assert m["complete"] and len(m["acc_matrix"]) == len(tasks)
    return m


def test_converted_cifar_task_trains_through_the_pipeline(assets, tmp_path):
    raw = cifar_raw(tmp_path / "raw", n_train=8, n_test=4)
    r = convert("cifar100", "--raw", raw, "--out", tmp_path / "cifar", "--classes-per-task", 2, "--seed", 0,
                "--shard-size", 4)
    assert r.returncode == 0, r.stderr
    m = _train(assets, tmp_path, tmp_path / "cifar", "cifar", ["task0", "task1"])
    assert m["test_counts"] == [8, 8]


def test_converted_image_folder_benchmarks_train(assets, tmp_path):
    """A task of each converted image-folder benchmark (ImageNet-R, DomainNet, CUB-200) in one sequence."""
    raw = tmp_path / "raw"
    imagenet_r_raw(raw / "inr")
    domainnet_raw(raw / "dn")
    cub_raw(raw / "cub")
    for r in (convert("imagenet_r", "--raw", raw / "inr", "--out", tmp_path / "inr", "--classes-per-task", 3),
              convert("domainnet", "--raw", raw / "dn", "--train-list", raw / "dn" / "sdomain_train.txt", "--test-list",
                      raw / "dn" / "sdomain_test.txt", "--out", tmp_path / "dn", "--classes-per-task", 2),
              convert("cub200", "--raw", raw / "cub", "--out", tmp_path / "cub", "--classes-per-task", 2)):
        assert r.returncode == 0, r.stderr
    tasks = [{"name": n, "train": str(tmp_path / n / "task0" / "train"), "test": str(tmp_path / n / "task0" / "test")}
             for n in ("inr", "dn", "cub")]
    m = _train(assets, tmp_path, None, "folders", tasks)
    assert m["test_counts"][1] == 2 * 2 * 1  # DomainNet: 2 classes x 2 domains x 1 test image


def test_converted_instruction_sets_train(mcit_assets, tmp_path):
    """One task of each public layout trains and is scored through the pipeline, with LLaVA-1.5's vicuna_v1
    conversation: CoIN ScienceQA (text-only questions beside image ones), TextVQA (annotation file), VizWiz
    (joined by image), UCIT ArxivQA (parquet / saved dataset) and VizWiz-caption (MCITlib's caption metrics),
    Fwd-Prompt's pre-trained space from a seeded mix665k sample (multi-turn and text-only conversations)."""
    out = convert_instruction_sets(tmp_path)
    coin, ucit = out["coin"], out["ucit"]
    names = {"scienceqa": coin, "textvqa": coin, "vizwiz": coin, "arxivqa": ucit, "vizwiz_caption": out["ucit_json"]}
    cfg = mcit_config(mcit_assets, tmp_path, "real_formats", data={"tasks": [
        {"name": n, "train": str(root / n / "train"), "test": str(root / n / "test")} for n, root in names.items()],
        "reference": str(out["mix_sample"] / "train")},
        backbone={"chat_format": "vicuna_v1"},
        train={"epochs": 1, "batch_size": 4, "lr": 0.05, "checkpoint_every": 2, "log_every": 2, "progress": False,
               "deepspeed_config": "deepspeed_configs/cpu.json"},
        eval={"zero_shot": False})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "real_formats"
    m = json.loads((run / "metrics.json").read_text())
    assert m["complete"] and m["test_counts"] == [3, 3, 2, 2, 3]
    assert m["scorers"] == ["coin_scienceqa", "coin_textvqa", "coin_vizwiz", "ucit_accuracy", "ucit_caption"]
    row = sorted(p for p in (run / "eval" / "answers").iterdir())[-1]
    sqa = {r["question_id"]: r for r in map(json.loads, (row / "0.jsonl").read_text().splitlines())}
    assert set(sqa) == {"sq0", "sq1", "sq2"} and "<image>" not in sqa["sq1"]["prompt"]  # the text-only question
    cap = json.loads((row / "4.metrics.json").read_text())
    assert cap["scorer"] == "ucit_caption" and set(cap["metrics"]) >= {"CIDEr", "Bleu_4", "METEOR", "ROUGE_L"}
    assert abs(m["acc_matrix"][-1][4] - 100 * cap["score"]) < 1e-6


def _tiny_judge(tokenizer_dir, out):
    """A local judge model: a one-layer Llama over the tiny LLaVA's tokenizer, with a text chat template (the
    prompt as one user turn, as a chat judge reads it)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = "{% for m in messages %}USER: {{ m['content'] }} {% endfor %}ASSISTANT:"
    import torch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=4096, bos_token_id=tok.bos_token_id,
                                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_mllm_cl_tasks_train_and_are_scored_by_their_scripts(mcit_assets, tmp_path):
    """One MLLM-DCL domain (Sci: its scorer reads the image's file name and the question) and two MLLM-ACL abilities
    (OCR: a list of answers and OCRBench's category; Math: MathVista's answer table and a local judge model) from
    their public layouts, converted, trained in one sequence and scored by MLLM-CL's rules: each answer row's score
    is the scorer's on that row's prediction, and a Math row the rule cannot read holds the judge's reply and the
    score of that reply."""
    from raw_formats import mllm_acl_raw, mllm_dcl_raw

    from mcit.core import judge as J
    from mcit.core import scorers as S

    dcl, acl = mllm_dcl_raw(tmp_path / "raw"), mllm_acl_raw(tmp_path / "raw")
    for args in (("mllm_dcl", "--instructions", dcl, "--task", "sci", "--out", tmp_path / "dcl"),
                 ("mllm_acl", "--instructions", acl, "--task", "ocr", "math", "--annotations",
                  f"math={acl / 'MathVista_MINI.tsv'}", "--out", tmp_path / "acl")):
        r = convert(*args)
        assert r.returncode == 0, r.stderr
        assert convert(args[0], "--verify", args[-1]).returncode == 0
    judge = _tiny_judge(mcit_assets["backbone"], tmp_path / "judge")
    cfg = mcit_config(mcit_assets, tmp_path, "mllm_cl", data={"tasks": [
        {"name": n, "train": str(root / n / "train"), "test": str(root / n / "test")}
        for n, root in (("sci", tmp_path / "dcl"), ("ocr", tmp_path / "acl"), ("math", tmp_path / "acl"))]},
        backbone={"chat_format": "vicuna_v1"},
        train={"epochs": 1, "batch_size": 2, "lr": 0.05, "checkpoint_every": 2, "log_every": 2, "progress": False,
               "deepspeed_config": "deepspeed_configs/cpu.json"},
        eval={"zero_shot": False, "judge": {"path": str(judge), "max_new_tokens": 6}})
    res = launch(["--config", str(cfg)], launcher="python")
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "runs" / "mllm_cl"
    m = json.loads((run / "metrics.json").read_text())
    assert m["complete"] and m["test_counts"] == [3, 3, 3]
    assert m["scorers"] == ["mllm_cl_sci", "mllm_cl_ocrbench", "mllm_cl_math"]
    row = sorted(p for p in (run / "eval" / "answers").iterdir())[-1]
    for i, name in enumerate(m["scorers"]):
        rows = [json.loads(line) for line in (row / f"{i}.jsonl").read_text().splitlines()]
        assert len(rows) == 3
        for r in rows:
            ref = {**r["reference"], "question": r["question"], "answers": r["answers"]}
            if name in J.JUDGED:
                pre = J.prefetch(r["prediction"], ref)
                assert (r["judge_log"] == "Prefetch succeed") == bool(pre)
                assert r["score"] == float(J.hit(pre if pre else r["judge_response"], ref))
            else:
                assert r["score"] == S.get(name)(r["prediction"], ref)
        assert abs(m["acc_matrix"][-1][i] - 100 * sum(r["score"] for r in rows) / 3) < 1e-9
    math_rows = [json.loads(line) for line in (row / "2.jsonl").read_text().splitlines()]
    assert any(isinstance(r["judge_response"], str) for r in math_rows)  # the judge answered some question
