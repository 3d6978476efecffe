"""State sharing: a newcomer downloads ``(metadata, tensors)`` from a peer that has them.

:mod:`~.state_sharing` is one averager's part (declaring itself a donor, serving, loading),
:mod:`~.download` the download from a chosen donor, and :mod:`~.witnesses` whether a
downloaded state may be used (other donors as witnesses).
"""
