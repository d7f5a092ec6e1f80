#!/usr/bin/env bash
# Constrained vs unconstrained decoding at the same load, against one `ember serve`.
#   benchmarks/structured_throughput.sh OUT_DIR [BASE_URL]
# Both make exactly 128 tokens per request: the unconstrained run bans EOS (ignore_eos,
# min_tokens); the constrained one asks for a JSON array of 60 short strings, which cannot
# close within 128 tokens. 32 chat requests, 64-token prompts, concurrency 8, run twice each,
# alternating.
set -euo pipefail
out=${1:?usage: benchmarks/structured_throughput.sh OUT_DIR [BASE_URL]}
url=${2:-http://127.0.0.1:8000/v1}
schema='{"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 60, "maxItems": 60}'
common=(--base-url "$url" --endpoint chat --num-requests 32 --concurrency 8 --input-len fixed:64
        --output-len fixed:128 --seed 0)
for run in 1 2; do
    .venv/bin/ember bench serve "${common[@]}" --label "free-$run" --out "$out/free-$run.json"
    .venv/bin/ember bench serve "${common[@]}" --no-force-output --label "json-$run" \
        --extra-body "{\"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"list\", \"schema\": $schema}}}" \
        --out "$out/json-$run.json"
done
.venv/bin/ember bench compare "$out"/free-1.json "$out"/json-1.json "$out"/free-2.json "$out"/json-2.json
