# AUTO at batch 1 on four Chinese prompts (docs/bench/prompts-zh-v1.jsonl), the draft's whole head against its first
# 65536 ids, alternated full, 65536, 65536, full (docs/performance.md, "A smaller draft head"). 9 min on CPU-D.
set -e
for v in 0 65536 65536 0; do
  i=$((i+1))
  tandem bench --threads 2 --methods tandem --prompts docs/bench/prompts-zh-v1.jsonl --draft-vocab $v \
      --json docs/bench/draft-vocab-zh-v1/run$i-v$v.json
done
