#!/usr/bin/env bash
# guidellm (a serving benchmark from PyPI: `pip install guidellm`, best in its own virtual
# environment) against `bole serve` on the bundled model: its default chat requests, then the
# same through /v1/completions, each for $SECONDS_EACH seconds (default 60) at $RATE requests a
# second (default 1). Prints each run's completed and errored request counts; exits 1 on any error.
#
#   bash bench/guidellm.sh [OUT_DIR]          # GUIDELLM=/path/to/guidellm to pick the binary
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/bole-guidellm}
guidellm=${GUIDELLM:-guidellm}
port=${PORT:-8017}
mkdir -p "$out"
command -v "$guidellm" >/dev/null || { echo "guidellm not found: pip install guidellm" >&2; exit 2; }

python -m bole.cli serve --port "$port" ${BOLE_SERVE_ARGS:-} > "$out/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "localhost:$port/health" >/dev/null && break
    sleep 1
done

status=0
for format in /v1/chat/completions /v1/completions; do
    name=$(basename "$format")
    "$guidellm" run --backend "kind=openai_http,target=http://localhost:$port,request_format=$format" \
        --profile "kind=constant,rate=${RATE:-1}" \
        --constraint "kind=max_duration,seconds=${SECONDS_EACH:-60}" \
        --data kind=synthetic_text,prompt_tokens=64,output_tokens=32 \
        --tokenizer kind=huggingface_auto,model=bole/bundled \
        --output "kind=json,path=$out/$name.json" --disable-console > "$out/$name.log" 2>&1
    python - "$out/$name.json" "$format" <<'EOF' || status=1
import json, sys
bench = json.load(open(sys.argv[1]))["benchmarks"][0]["requests"]
done, errored = len(bench.get("successful", [])), len(bench.get("errored", []))
print(f"{sys.argv[2]}: {done} completed, {errored} errored, {len(bench.get('incomplete', []))} incomplete")
sys.exit(1 if errored or not done else 0)
EOF
done
exit $status
