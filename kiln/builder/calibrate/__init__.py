"""Build-time calibration over the model's own blocks: static input scales and channel amax
(calibration.py), GPTQ rounding (gptq.py, sequential.py), SmoothQuant factors (smoothing.py),
float8 KV-cache scales (kv_scales.py). Every pass wraps projections' linear methods or runs
DecoderLayer.forward; none re-implements a layer. The run-time schemes they feed are
kiln.layers.quantization's."""
