"""The frozen target's feature forward: eager, with the GDN layer route, and replayed as CUDA graphs.

transformers up to 5.2x copies the GDN layers' q and k to the value heads (``repeat_interleave``) before
the delta rule; ``use_dflash_kernels(model, gdn_layers=True)`` replaces those layers' cache-less forward
by one that gives the kernels q and k at their own head count. This script times what the route
changes, where it applies: the trainer's target forward (``Target.features``, no grad) of the real
preset's random Qwen3.5-4B-like target (32 layers, 24 of them GDN, 3072 tokens, bf16; norms, MLPs and
RoPE routed as in tok_s's (a)). A third row replays the same forward as CUDA graphs
(``Target.use_cuda_graphs``, the trainer's ``--target-cuda-graphs``), which removes the host's
per-launch work. Each setting runs in a process of its own: the ``do_bench`` median, the device time
per forward from the profiler (5 forwards), and the features' relative difference from the eager row.
With transformers that does not copy (no route to apply) the first two rows run the same code.

    python -m tools.studies.bench_target_forward            # needs a CUDA GPU
"""

import argparse
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository


MODES = ("eager", "route", "graphs")


def worker(mode: str, out_path: str) -> None:
    from transformers import Qwen3_5TextConfig
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.bench_common import bench_ms
    from benchmarks.tok_s import _random_qwen35_target
    from dflash_kernels.integrations.transformers import use_dflash_kernels
    from trainer.config import preset

    text = Qwen3_5TextConfig(vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                             linear_conv_kernel_dim=4, max_position_embeddings=262144, tie_word_embeddings=True,
                             pad_token_id=0)
    target = _random_qwen35_target(text, preset("default", device="cuda", batch_size=1), torch.device("cuda"),
                                   torch.bfloat16, elementwise=True)
    routing = use_dflash_kernels(target.model, elementwise=True, gdn_layers=mode == "route")
    if mode == "graphs":
        target.use_cuda_graphs()
    routes = [key for key in routing._patched if key[1].endswith("GatedDeltaNet.forward")]
    ids = torch.randint(8, text.vocab_size, (1, 3072), generator=torch.Generator().manual_seed(0)).cuda()
    feats = target.features(ids)
    ms = bench_ms(lambda: target.features(ids))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            target.features(ids)
        torch.cuda.synchronize()
    device_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 5 / 1e3
    torch.save({"feats": feats.float().cpu(), "ms": ms, "device_ms": device_ms, "routes": routes}, out_path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.out)
    if not torch.cuda.is_available():
        raise SystemExit("bench_target_forward: needs a CUDA GPU (a 4B-parameter target at 3072 tokens)")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            path = os.path.join(tmp, mode + ".pt")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", mode, "--out", path], check=True)
            rows[mode] = torch.load(path)
    import transformers
    print(f"target features, real preset | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"transformers {transformers.__version__}")
    ref = rows["eager"]["feats"]
    for mode, r in rows.items():
        diff = ((r["feats"] - ref).norm() / ref.norm()).item()
        print(f"  {mode:>6}: {r['ms']:.2f} ms (do_bench median), {r['device_ms']:.2f} device ms, GDN layer classes "
              f"routed: {len(r['routes'])}, features vs eager: {diff:.2e}")


if __name__ == "__main__":
    main()
