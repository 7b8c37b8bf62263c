"""PLACEHOLDER: being written; replace this whole file."""
def SparseDecodePagedAttentionWrapper(*a, **k):
    raise NotImplementedError('SparseDecodePagedAttentionWrapper: not written yet')
def sparse_decode_atten_func(*a, **k):
    raise NotImplementedError('sparse_decode_atten_func: not written yet')
