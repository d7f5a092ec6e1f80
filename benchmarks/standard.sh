#!/usr/bin/env bash
# The standard serving workloads, ember beside peer servers, each run by `ember bench peers`.
#   benchmarks/standard.sh OUT_DIR PEER_SPEC [PEER_SPEC ...]
# OUT_DIR takes the results (keep it outside the repository, e.g. ~/.cache/ember/bench/standard;
# benchmarks/standard_table.py OUT_DIR prints the table). PEER_SPEC is NAME=COMMAND with {port}
# and {model} filled in, for example
#   'llama-server=llama-server -m {model} --port {port} -t 2 --threads-batch 2 -c 65536
#    -np 32 --host 127.0.0.1'
# EOS is banned with logit_bias (token 2 is SmolLM2's <|im_end|>) so that servers without
# ignore_eos make the asked-for lengths too. Extra `ember serve` options: EMBER_ARGS.
set -euo pipefail
out=${1:?usage: benchmarks/standard.sh OUT_DIR PEER_SPEC...}
shift
peers=()
for spec in "$@"; do peers+=(--peer-cmd "$spec"); done
bench=(.venv/bin/ember bench peers "${peers[@]}" --ember-args "${EMBER_ARGS:-}"
       --extra-body '{"logit_bias": {"2": -100}}' --seed 0)

"${bench[@]}" --input-len fixed:32 --output-len fixed:256 --num-requests 4 --concurrency 1 \
    --label a-one-stream --out "$out/a-one-stream.json"
"${bench[@]}" --input-len fixed:1024 --output-len fixed:1 --num-requests 5 --concurrency 1 \
    --label b-ttft-1024 --out "$out/b-ttft-1024.json"
for c in 8 32; do
    "${bench[@]}" --input-len uniform:100,400 --output-len uniform:64,192 --num-requests 64 \
        --concurrency "$c" --label "c-mixed-c$c" --out "$out/c-mixed-c$c.json"
done
"${bench[@]}" --workload shared-prefix --groups 1 --per-group 32 --prefix-len 600 \
    --suffix-len 20 --output-len fixed:32 --concurrency 8 --label d-shared-prefix \
    --out "$out/d-shared-prefix.json"
