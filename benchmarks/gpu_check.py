"""The speed issue's accelerator check: Llama-3.1-8B shapes with random bf16 weights, a 32k-token prompt, budget
2048, blocks of 128 and 512 (see `caote.benchmark.gpu`). Prints the table and writes gpu_check.{json,md}.

python benchmarks/gpu_check.py --out "$OUT"            # on the GPU machine
python benchmarks/gpu_check.py --tiny --out /tmp/gpu    # the same code path on a tiny model, on the CPU
"""

import argparse
from pathlib import Path

import torch

from caote.arguments import int_tuple
from caote.benchmark.gpu import LLAMA_31_8B, TINY_SHAPES, gpu_check, random_model, run_meta, write_check
from caote.policies import expand_policies


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and a short prompt (a CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompt-tokens", type=int, help="default 32768 (--tiny: 256)")
    parser.add_argument("--budget", type=int, help="default 2048 (--tiny: 64)")
    parser.add_argument("--blocks", type=int_tuple, help="default 128,512 (--tiny: 16,32)")
    parser.add_argument("--policies", default="streamingllm,tova+caote,snapkv+caote")
    parser.add_argument("--new-tokens", type=int, help="decoded tokens per configuration, default 64 (--tiny: 4)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    small = args.tiny
    prompt = args.prompt_tokens or (256 if small else 32768)
    budget = args.budget or (64 if small else 2048)
    blocks = args.blocks or ((16, 32) if small else (128, 512))
    new_tokens = args.new_tokens if args.new_tokens is not None else (4 if small else 64)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(TINY_SHAPES if small else LLAMA_31_8B, args.device, dtype)
    name = f"{'tiny Llama' if small else 'Llama-3.1-8B shapes'}, random weights, {str(dtype).removeprefix('torch.')}"
    meta = run_meta(name, args.device, prompt, budget, new_tokens)
    out = Path(args.out)
    results = gpu_check(
        model, prompt, budget, blocks, expand_policies(args.policies), new_tokens, args.device,
        save=lambda partial: write_check(partial, meta, out),
    )  # fmt: skip
    path = write_check(results, meta, out)
    print(path.read_text())
    return path


if __name__ == "__main__":
    main()
