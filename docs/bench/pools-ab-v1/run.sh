#!/bin/bash
# tandem serve (Ray pools: gateway + draft actor + target actor) from two checkouts, A B B A, 8 in flight
# run from the checkout under test; BEFORE: a worktree of the commit before (ece2c1a)
i=0
for v in old new new old; do
  if [ $v = old ]; then pp=$BEFORE/services; else pp=$PWD/services; fi
  port=$((50170 + i))
  PYTHONPATH=$pp python -m tandem serve --port $port --max-batch 8 --threads 2 --no-metrics > $OUT/pools-server-$v-$i.log 2>&1 &
  spid=$!
  PYTHONPATH=$pp python - <<PY
import time
from tandem.client import TandemClient
with TandemClient("127.0.0.1:$port", timeout=5) as c:
    for _ in range(300):
        try:
            if c.health_status("tandem.v1.GenerationService") == 1: break
        except Exception: pass
        time.sleep(2)
PY
  (sleep 25; for p in $(pgrep -f "ray::.*Worker"); do echo "$p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-40) $(PYTHONPATH=$PWD/services python -c "from tandem.bench.served_ab import thread_cpu; print(thread_cpu($p, 5))")"; done > $OUT/pools-threads-$v-$i.txt) &
  PYTHONPATH=$pp python -m tandem.bench.serving --address 127.0.0.1:$port --concurrency 8 --max-tokens 128 --json $OUT/pools-$v-$i.json 2>&1 | tail -3 | sed "s/^/$v $i /"
  kill -TERM $spid; wait $spid
  i=$((i+1))
done
