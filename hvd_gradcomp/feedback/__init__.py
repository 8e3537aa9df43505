"""Error feedback: what each rank sends for a gradient, and what the optimizer gets back.

A compressor (the codec: ``encode``/``decode``) is paired with a *feedback policy* that owns
all state that lives across steps (residuals, velocities, held estimates). For every tensor
and step the exchange calls, in this order:

1. ``prepare(name, grad) -> acc``: the flat tensor to encode (e.g. gradient + residual);
2. ``sent(name, acc, what)``: told what the payload *actually* carries (sparse
   ``(indices, values)`` or the QSGD codes), so the policy acts on facts, not on a re-run of
   top-k;
3. ``received(name, avg)``: the average of every rank's decoded payload, identical on all
   ranks; the policy may rewrite it in place into what the wrapped optimizer should see.

Policies (``feedback=`` on every compressor; ``"auto"`` picks one from the wrapped optimizer,
see :func:`choose`):

* :class:`NoFeedback` (``"none"``): send the gradient as it is.
* :class:`ErrorFeedback` (``"classic"``): Seide et al. 2014 / Stich et al. 2018. Invariant,
  checked by the tests: ``sent + new_residual == input + old_residual``.
* :class:`MomentumCorrection` (``"momentum"``): DGC's momentum correction (Lin et al., 2018)
  for ``torch.optim.SGD(momentum=m)``, done at the gradient level so the optimizer is left
  alone: each rank sends its own velocity ``u = m*u + g`` through error feedback; the
  optimizer is handed ``(D_t - m*D_{t-1})/(1-dampening)`` where ``D_t`` is the averaged sent
  velocity, so that SGD's own momentum buffer becomes exactly ``D_t``. At ratio 1 this is
  bit-for-bit momentum SGD (also with weight decay, dampening and Nesterov).
* :class:`FrozenVariance` (``"frozen"``): for ``Adam`` and ``AdamW``: a dense warm-up of exact
  Adam, then its second moment is frozen (identical on every rank, as in 1-bit Adam, Tang et
  al. 2021) and each rank's gradient, divided by it, goes through error feedback, whose residual
  takes the first moment's place; Adam is then linear, so error feedback delays movement but
  loses none.
* :class:`LocalUpdate` (``"update"``): for other adaptive optimizers (RMSprop, Adagrad, ...): each rank
  runs the optimizer's algorithm on its own gradient and the *parameter change* goes through
  error feedback; the wrapped optimizer only applies decoupled weight decay. Adam normalises
  per coordinate, so the spikes of error feedback on gradients (zero for ~1/ratio steps, then
  the sum) shrink its steps; updates keep their total movement.

Residuals are keyed by a stable name (the parameter name), never by tensor identity, so they
survive re-created gradient tensors and checkpoints.

The package's modules:

* :mod:`~hvd_gradcomp.feedback.kernels`: error feedback's arithmetic (the residual added in the pass that
  marks top-k candidates, finiteness checks, the float16 cast's saturation, ``torch.compile`` on demand);
* :mod:`~hvd_gradcomp.feedback.names`: the one map from parameters to the names state is keyed by;
* :mod:`~hvd_gradcomp.feedback.residuals`: :class:`ResidualStore` and :class:`HalfPrecision`, what a rank
  keeps of what it did not send, and the helpers on residuals;
* :mod:`~hvd_gradcomp.feedback.policy`: the :class:`Feedback` protocol, :class:`NoFeedback`,
  :class:`ErrorFeedback` and :class:`LocalUpdate`;
* :mod:`~hvd_gradcomp.feedback.registry`: policies by name (:func:`make`) and the one ``"auto"`` picks
  (:func:`choose`);
* :mod:`~hvd_gradcomp.feedback.momentum`: :class:`MomentumCorrection`;
* :mod:`~hvd_gradcomp.feedback.frozen` (built of the parts in ``frozen_warmup``, ``frozen_scale``,
  ``frozen_momentum``, ``frozen_adam`` and ``frozen_denom``): :class:`FrozenVariance`.
"""
from .residuals import (HALF_DTYPES, Marked, ResidualStore, HalfPrecision, Sent, log, residual_dtype, spare_or_new,
                        subtract_sent)
from .policy import (SPARSITY_WARMUP, ErrorFeedback, Feedback, LocalUpdate, NoFeedback, check_sparsity_warmup,
                     known_terms, plain_class)
from .registry import ADAPTIVE, FROZEN_VARIANCE_CLASSES, POLICIES, announce, choose, frozen_variance_unsupported, make

__all__ = ["HALF_DTYPES", "Sent", "Marked", "log", "residual_dtype", "spare_or_new", "subtract_sent", "ResidualStore",
           "HalfPrecision", "plain_class", "Feedback", "NoFeedback", "ErrorFeedback", "SPARSITY_WARMUP", "known_terms",
           "check_sparsity_warmup", "LocalUpdate", "FROZEN_VARIANCE_CLASSES", "frozen_variance_unsupported", "POLICIES",
           "make", "ADAPTIVE", "choose", "announce"]
