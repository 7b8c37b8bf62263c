"""PLACEHOLDER: being written; replace this whole file."""
def Nvfp4QuantizedTensor(*a, **k):
    raise NotImplementedError('Nvfp4QuantizedTensor: not written yet')
def dequantize_nvfp4_128x4_to_bf16(*a, **k):
    raise NotImplementedError('dequantize_nvfp4_128x4_to_bf16: not written yet')
def nvfp4_global_scale_from_amax(*a, **k):
    raise NotImplementedError('nvfp4_global_scale_from_amax: not written yet')
def quantize_bf16_to_nvfp4_128x4(*a, **k):
    raise NotImplementedError('quantize_bf16_to_nvfp4_128x4: not written yet')
def quantize_kv_bf16_to_nvfp4_128x4(*a, **k):
    raise NotImplementedError('quantize_kv_bf16_to_nvfp4_128x4: not written yet')
def swizzle_nvfp4_scale_to_128x4(*a, **k):
    raise NotImplementedError('swizzle_nvfp4_scale_to_128x4: not written yet')
