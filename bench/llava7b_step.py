"""LLaVA-1.5-7B with Fwd-Prompt: the architecture without weights (any machine), and where CUDA is
present one ZeRO-2 bf16 training step of the real-size model (random weights) with throughput and memory.

    python bench/llava7b_step.py                     # meta build: parameter counts
    deepspeed --num_gpus 1 bench/llava7b_step.py --steps 5 --batch 4   # on a GPU: + timed steps
    deepspeed --num_gpus 1 bench/llava7b_step.py --quantization 4bit  # the frozen LLM in nf4 (bitsandbytes)

On a GPU it prints samples/s, tokens/s, peak memory and model FLOPs utilisation (MFU) against
``--peak-tflops`` (default 989, H100 SXM dense bf16). Model FLOPs count 6 N T for the language model
(the usual convention, as if every weight had a gradient) plus 2 N T for the vision tower and projector
(forward only: nothing upstream of them trains); "needed" FLOPs count 4 N T for the frozen LLM
(activation gradients only, no weight gradients), which is what a frozen-backbone step really computes.
4-bit: the random model is saved once in bf16 (``--save-dir``) and reloaded through transformers'
``from_pretrained`` with the project's own ``quantization_config`` (what ``backbone.quantization`` does).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="fwd_prompt", choices=["fwd_prompt", "prompt_tuning", "lora"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--quantization", default="none", choices=["none", "4bit", "8bit"])
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="also time greedy generation of N new tokens for the batch: the method's generate (prompt "
                         "selection, prompts inserted, KV-cached decoding) against transformers' generate")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU")
    ap.add_argument("--save-dir", default="/tmp/mcit_llava7b_random", help="where --quantization keeps the bf16 copy")
    args = ap.parse_args(argv)

    from mcit.core.registry import METHODS
    from mcit.data.types import TaskSequence
    from mcit.models.mllm import build_empty, llava_config

    seq = TaskSequence.from_label_spaces(["t"], [[]])
    cls = METHODS.get(args.method)
    empty = build_empty("llava-1.5-7b")
    method = cls(cls.Params(), empty, seq)
    n_backbone = sum(p.numel() for p in empty.model.parameters() if not any(p is q for q in method.parameters()))
    n_train = sum(p.numel() for p in method.trainable_parameters())
    print(f"LLaVA-1.5-7B architecture built on the meta device: {n_backbone / 1e9:.3f} B frozen parameters")
    print(f"{args.method} ({cls.Params().model_dump()}): {n_train:,} trainable parameters "
          f"({100 * n_train / n_backbone:.4f}% of the backbone)")
    if not torch.cuda.is_available():
        print("no CUDA device: the bf16 ZeRO-2 training step is skipped here")
        return 0

    from transformers import LlavaForConditionalGeneration

    from mcit.core import distributed as dist
    from mcit.core.config import validate_config
    from mcit.data.types import Batch
    from mcit.models.llava import LlavaBackbone
    from mcit.models.mllm import MLLMBackbone, quantization_config
    from mcit.run.engine import setup_engine, train_step

    dist.init()
    cfg = llava_config("llava-1.5-7b")
    torch.manual_seed(0)
    t_build = time.perf_counter()
    if args.quantization == "none":
        with torch.device(dist.device()):
            model = LlavaForConditionalGeneration(cfg).to(torch.bfloat16)
    else:
        save = Path(args.save_dir)
        if not (save / "config.json").exists():
            with torch.device(dist.device()):
                LlavaForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(str(save))
            torch.cuda.empty_cache()
        qc = quantization_config(args.quantization, torch.bfloat16, LlavaBackbone.unquantized)
        model = LlavaForConditionalGeneration.from_pretrained(str(save), dtype=torch.bfloat16, quantization_config=qc,
                                                              device_map={"": dist.device()})
    print(f"model ready ({args.quantization}) in {time.perf_counter() - t_build:.1f} s; weights "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU", flush=True)
    bb = MLLMBackbone.wrap(model, None)
    n_vis = sum(p.numel() for n, p in empty.model.named_parameters()
                if "vision_tower" in n or "multi_modal_projector" in n)
    n_lm = sum(p.numel() for n, p in empty.model.named_parameters()
               if not ("vision_tower" in n or "multi_modal_projector" in n or "embed_tokens" in n))
    run = validate_config({"name": "b", "backbone": {"kind": "llava", "path": "unused"},
                           "data": {"tasks": ["t"], "root": "."}, "method": {"name": args.method},
                           "train": {"batch_size": args.batch, "lr": 0.03, "precision": "bf16",
                                     "deepspeed_config": "deepspeed_configs/zero2.json"}})
    method = cls(cls.Params(), bb, seq).to(dist.device())
    engine, _ = setup_engine(run, method, dist.world_size())
    B, n_img, T = args.batch, cfg.image_seq_length, args.text_tokens
    ids = torch.randint(3, 32000, (B, 1 + n_img + T))
    ids[:, 1:1 + n_img] = cfg.image_token_index
    labels = torch.full_like(ids, -100)
    labels[:, -8:] = ids[:, -8:]
    batch = Batch(torch.randn(B, 3, 336, 336), labels, torch.ones(B), 0, [f"s{i}" for i in range(B)],
                  inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids)}).to(dist.device())
    torch.cuda.reset_peak_memory_stats()
    train_step(engine, batch, 1.0 / B)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(engine, batch, 1.0 / B)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    t_lm = ids.shape[1] + getattr(method.params, "top_n", 0) * getattr(method.params, "prompt_length", 0)
    t_vis = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2 + 1
    model_flops = B * (6 * n_lm * t_lm + 2 * n_vis * t_vis)
    needed_flops = B * (4 * n_lm * t_lm + 2 * n_vis * t_vis)
    step_s = dt / args.steps
    print(f"ZeRO-2 bf16 step ({args.quantization}), batch {B}, {t_lm} LLM tokens per sample (prompts included): "
          f"{step_s * 1000:.0f} ms/step, {args.steps * B / dt:.2f} samples/s, "
          f"{args.steps * B * t_lm / dt:,.0f} tokens/s, "
          f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB on {torch.cuda.get_device_name()}")
    print(f"MFU {100 * model_flops / step_s / (args.peak_tflops * 1e12):.1f}% (6NT model FLOPs, "
          f"{model_flops / step_s / 1e12:.0f} TFLOP/s); needed-FLOPs utilisation "
          f"{100 * needed_flops / step_s / (args.peak_tflops * 1e12):.1f}% (4NT, frozen LLM) of "
          f"{args.peak_tflops:.0f} TFLOP/s")
    if args.generate:
        time_generation(method, model, batch, args.generate, cfg.text_config.vocab_size)
    return 0


def time_generation(method, model, batch, new_tokens: int, vocab: int, rounds: int = 3) -> None:
    """Greedy decoding of ``new_tokens`` for the batch through the method (what the eval stage calls) and
    through transformers' ``generate`` on the same ids and pixels, alternating, median of ``rounds``. Random
    weights have no tokenizer: a word-level one over the vocabulary's ids decodes (eos = id 2, as LLaVA's)."""
    import statistics

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    # padding and EOS get names no word contains: special tokens named "w0" / "w2" were found inside "w29720",
    # which then counted as four tokens
    names = {f"w{i}": i for i in range(vocab)}
    names.pop("w0"), names.pop("w2")
    words = Tokenizer(WordLevel({**names, "<pad>": 0, "</s>": 2}, unk_token="<pad>"))
    words.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>")
    method.backbone.tokenizer = tok
    method.eval()
    ids, mask = batch.inputs["input_ids"], batch.inputs["attention_mask"]
    pixels = batch.pixel_values.to(torch.bfloat16)

    def ours() -> int:
        return sum(len(a.split()) for a in method.generate(batch, new_tokens))  # words = tokens, EOS not counted

    @torch.no_grad()
    def hf() -> int:
        out = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=mask, max_new_tokens=new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=2)
        new = out[:, ids.shape[1]:]
        return int(((new != 0) & (new != 2)).sum())

    times: dict[str, list[float]] = {"method generate": [], "transformers generate": []}
    made: dict[str, int] = {}
    for r in range(rounds + 1):  # the first round warms up
        for name, fn in (("method generate", ours), ("transformers generate", hf)):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            made[name] = fn()
            torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - t0)
    B = ids.shape[0]
    for name, v in times.items():
        dt = statistics.median(v)
        print(f"{name}: batch {B}, {ids.shape[1]} prompt tokens, up to {new_tokens} new: {dt * 1000:.0f} ms, "
              f"{made[name] / dt:,.0f} new tokens/s ({made[name]} made)")
    print(f"ratio method / transformers generate (time) = "
          f"{statistics.median(a / b for a, b in zip(times['method generate'], times['transformers generate'])):.3f}")


if __name__ == "__main__":
    from mcit.core.distributed import exit_process

    exit_process(main())
