# GPU: one fresh-process sweep child (benchmarks/first_call.py) with fresh caches, RESULT printed
# usage: bash scratch/run_child.sh BACKEND STATE
d=$(mktemp -d)
spec="{\"workload\": \"dynamic_mlp_sweep\", \"backend\": \"$1\", \"dtype\": \"bfloat16\", \"size\": [[100, 134, 179, 240, 322, 431, 577, 773, 1035, 1386, 1857, 2487, 3330, 4460, 5973, 8000], 1024, 4096, 1024], \"seed\": 1, \"cache_dir\": \"$d\", \"state\": \"$2\", \"caches\": false, \"steady\": false, \"check\": true, \"repeats\": 5, \"min_round_s\": 0.01, \"warmup\": 2}"
PALLASKIT_CACHE=1 PALLASKIT_CACHE_DIR=$d/pallaskit TRITON_CACHE_DIR=$d/triton TORCHINDUCTOR_CACHE_DIR=$d/inductor XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.first_call "$spec" 2>&1 | grep -v "^I1\|^W1" | python3 -c "
import sys, json
for line in sys.stdin:
    if line.startswith('RESULT '):
        r = json.loads(line[7:])
        print('total', round(r.get('total_first_s', -1), 3), r.get('note'), r.get('error'), 'rel_err', r.get('rel_err'))
        print('per size (ms):', [round(1e3 * c['first_s'], 1) for c in r.get('cases', [])])
    else:
        print(line.rstrip()[:300])
"
