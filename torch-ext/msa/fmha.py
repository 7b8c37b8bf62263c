"""PLACEHOLDER: being written; replace this whole file."""
def fmha(*a, **k):
    raise NotImplementedError('fmha: not written yet')
def fmha_plan(*a, **k):
    raise NotImplementedError('fmha_plan: not written yet')
def fmha_sm100(*a, **k):
    raise NotImplementedError('fmha_sm100: not written yet')
def fmha_sm100_plan(*a, **k):
    raise NotImplementedError('fmha_sm100_plan: not written yet')
def sparse_fmha(*a, **k):
    raise NotImplementedError('sparse_fmha: not written yet')
def sparse_fmha_plan(*a, **k):
    raise NotImplementedError('sparse_fmha_plan: not written yet')
