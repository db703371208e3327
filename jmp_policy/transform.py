"""PLACEHOLDER (owned by the loss-scaling helper): the optax transformation."""
class LossScalingState: ...
def loss_scaling(inner, loss_scale="dynamic", *, axis_name=None): raise NotImplementedError
def get_loss_scale(opt_state): raise NotImplementedError
def scaled_value_and_grad(fun, argnums=0, has_aux=False): raise NotImplementedError
