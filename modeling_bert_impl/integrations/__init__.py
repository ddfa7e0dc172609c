"""bert-impl beside the rest of the ecosystem: PEFT's defaults, `apply_bert_impl` for stock BERT code, ONNX export,
and the Hub's model card. Not part of a saved folder's code."""
