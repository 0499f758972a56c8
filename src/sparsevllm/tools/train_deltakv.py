"""python -m sparsevllm.tools.train_deltakv: train a DeltaKV compressor for a model.

    python -m sparsevllm.tools.train_deltakv --out DIR [--model DIR] [--data FILE] [--steps 200] ...

The model stays frozen (Hugging Face transformers, fp32 on a CPU, bf16 on a GPU). In every sparse
layer (every layer but the full ones) attention reads reconstructed KV where the engine would: the
k_proj of that layer computes K and V together (K after the per-head k-norm where the model has one,
as the engine's cache sees it), sends x = [K ; V] through the compressor (references raw, every
other token through its latent and its nearest references' mean), and attention reads a key's
reconstruction when it is --recent or more tokens behind the query and its raw KV when it is
nearer, as the engine keeps the recent window raw. (`--recent 0` reconstructs every non-reference
token, as the authors' trainer does; measured on SmolLM2 that lets the compressor act as an adapter
that lowers the loss on the training text below the dense model's while reconstructing far tokens
badly, and the engine then loses needles.) The loss is the next-token cross-entropy plus
mse_weight x the MSE between reconstructed and true x (default 10, the paper's sum has weight 1:
at 1 the cross-entropy still shapes the far tokens into whatever lowers the loss on the training text,
held-out CE ends below the dense model's and needles are lost; at 10 it ends near the dense model's
and SmolLM2 finds far more needles). Only the compressor trains.

Data: --data (a text file) or, by default, CPython's documentation text (`pydoc_data`), which every
Python has; windows of --seq_len tokens, drawn with --seed. A progress bar shows the losses; every
--save_every steps a checkpoint (compressor, optimizer, step, data position) goes to OUT/checkpoint,
and --resume continues from it. The compressor (compressor.safetensors + compressor.json) is written
to OUT at the end, with the training data, steps and final losses in its JSON.
"""
import argparse
import logging
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsevllm.tools.train_deltakv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, help="folder for the compressor (and OUT/checkpoint)")
    ap.add_argument("--data", default=None, help="a text file (default: CPython's pydoc_data documentation text)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--mse_weight", type=float, default=10.0,
                    help="weight of the MSE beside the cross-entropy (the paper: 1; 10 measured better, see the "
                         "regression README)")
    ap.add_argument("--latent_dim", type=int, default=128)
    ap.add_argument("--type", default="linear",
                    help="the projections: linear (one Linear each way) or mlp_gelu (Linear-GELU-Linear)")
    ap.add_argument("--cluster_ratio", type=float, default=0.1)
    ap.add_argument("--neighbors", type=int, default=4)
    ap.add_argument("--sink", type=int, default=8)
    ap.add_argument("--recent", type=int, default=128,
                    help="keys nearer than this to the query stay raw, as in the engine (deltakv_recent); 0: none")
    ap.add_argument("--full_layers", default=None, help="comma list of raw layers (default: 0,1,2,8,18 of 32, scaled)")
    ap.add_argument("--save_every", type=int, default=50)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--evaluate", type=int, default=0, metavar="N",
                    help="train nothing: print the frozen model's cross-entropy dense and with OUT's compressor "
                         "(at --recent) and its MSE, on N windows of --seq_len tokens drawn with --seed + 1")
    args = ap.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "save_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.recent < 0:
        ap.error("--recent must be >= 0")
    logging.basicConfig(level=logging.WARNING)
    from sparsevllm.tools.deltakv_training import train   # torch and transformers: after --help and usage errors
    return train(args, ap)


if __name__ == "__main__":
    sys.exit(main())
