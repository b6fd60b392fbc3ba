#!/usr/bin/env python3
"""Trains a small transformer for real and writes its float32 master weights after every step.

bench/run-delta-encoding feeds them to patch_bench, which publishes each step as bfloat16 and
measures the patches of issue 35 against the step before. Plain torch on the CPU: a 4-layer
transformer (d_model 512, 8 heads, feed-forward 2048, vocabulary 1000: about 13.6 M parameters),
AdamW, random token batches, next-token loss. The weights' bf16 changes from one step to the next
depend on the learning rate and the optimizer, not on what is learnt.

Usage: delta_train.py DIR --lr 1e-6 [--steps 6] [--seed 0]
Writes DIR/params.tsv (name, elements, per line) and DIR/step-K.f32 (every parameter, flattened,
in that order, little-endian float32) for K = 0 (the initial weights) .. steps.
"""
import argparse
import os

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    vocabulary, width, sequence, batch = 1000, 512, 64, 8
    layer = torch.nn.TransformerEncoderLayer(d_model=width, nhead=8, dim_feedforward=2048, batch_first=True)
    model = torch.nn.ModuleDict({
        "embed": torch.nn.Embedding(vocabulary, width),
        "layers": torch.nn.TransformerEncoder(layer, num_layers=4),
        "head": torch.nn.Linear(width, vocabulary),
    })
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    os.makedirs(args.dir, exist_ok=True)
    named = list(model.named_parameters())
    with open(os.path.join(args.dir, "params.tsv"), "w") as out:
        for name, parameter in named:
            out.write(f"{name}\t{parameter.numel()}\n")

    def dump(step):
        flat = torch.cat([parameter.detach().reshape(-1) for _, parameter in named]).to(torch.float32)
        flat.numpy().tofile(os.path.join(args.dir, f"step-{step}.f32"))

    dump(0)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(sequence)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, vocabulary, (batch, sequence + 1))
        hidden = model["layers"](model["embed"](tokens[:, :-1]), mask=mask)
        loss = torch.nn.functional.cross_entropy(model["head"](hidden).reshape(-1, vocabulary), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        dump(step)
    total = sum(parameter.numel() for _, parameter in named)
    print(f"delta_train: {total} parameters in {len(named)} tensors, {args.steps} steps at lr {args.lr:g}")


if __name__ == "__main__":
    main()
