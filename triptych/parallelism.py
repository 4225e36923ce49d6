"""Per-role parallel degrees: derive what is not given, reject what does not fit.

Shared by `triptych serve` and the operator so a DiffusionPipeline is validated exactly as the
process that will run it validates its flags. Explicit incompatible values are an error; they
are never silently reduced to fit.
"""

from __future__ import annotations

from dataclasses import dataclass


class ParallelismError(ValueError):
    """Degrees that do not fit the GPUs; the message names the flag or field and the fix."""


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    sp: int = 1
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1


def resolve_parallelism(
    num_gpus: int,
    *,
    tp: int | None = None,
    sp: int | None = None,
    ulysses: int | None = None,
    ring: int | None = None,
    cfg: int | None = None,
    where: str = "--",
) -> Parallelism:
    """Fill in unset degrees so tp * sp * cfg == num_gpus and ulysses * ring == sp.

    `where` prefixes names in messages: "--denoiser-" for flags, "spec.denoiser.parallelism." for a CR.
    """
    if num_gpus < 1:
        raise ParallelismError(f"{where}num-gpus is {num_gpus}; it must be >= 1")
    for name, value in (("tp", tp), ("sp", sp), ("ulysses", ulysses), ("ring", ring), ("cfg", cfg)):
        if value is not None and value < 1:
            raise ParallelismError(f"{where}{name} is {value}; parallel degrees must be >= 1")
    cfg_ = cfg or 1
    tp_ = tp or 1
    if sp is None:
        if ulysses is not None and ring is not None:
            sp_ = ulysses * ring
        else:
            if num_gpus % (tp_ * cfg_):
                raise ParallelismError(
                    f"{where}tp={tp_} x cfg={cfg_} does not divide {num_gpus} GPUs; "
                    f"choose degrees whose product is {num_gpus}"
                )
            sp_ = num_gpus // (tp_ * cfg_)
    else:
        sp_ = sp
    if tp_ * sp_ * cfg_ != num_gpus:
        raise ParallelismError(
            f"{where}tp={tp_} x sp={sp_} x cfg={cfg_} = {tp_ * sp_ * cfg_}, but the role has {num_gpus} GPUs; "
            f"make the product equal the GPU count or leave a degree unset to derive it"
        )
    if ulysses is None and ring is None:
        ulysses_, ring_ = sp_, 1
    elif ulysses is None:
        ring_ = ring or 1
        if sp_ % ring_:
            raise ParallelismError(f"{where}ring={ring_} does not divide sp={sp_}")
        ulysses_ = sp_ // ring_
    elif ring is None:
        ulysses_ = ulysses
        if sp_ % ulysses_:
            raise ParallelismError(f"{where}ulysses={ulysses_} does not divide sp={sp_}")
        ring_ = sp_ // ulysses_
    else:
        ulysses_, ring_ = ulysses, ring
    if ulysses_ * ring_ != sp_:
        raise ParallelismError(f"{where}ulysses={ulysses_} x ring={ring_} must equal sp={sp_}")
    return Parallelism(tp=tp_, sp=sp_, ulysses=ulysses_, ring=ring_, cfg=cfg_)
