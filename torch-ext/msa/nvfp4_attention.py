"""PLACEHOLDER: being written; replace this whole file."""
def sparse_atten_nvfp4_kv_func(*a, **k):
    raise NotImplementedError('sparse_atten_nvfp4_kv_func: not written yet')
