"""The process and the job: joining a multi-process job (`distributed`), never hanging
(`watchdog`), preemption notices, exit statuses, the compilation cache, the GPU
performance settings (`gpu_flags`), simulated CPU devices (`cpu_devices`), and the one
module for jax's internals and the differences between jax versions (`jax_compat`)."""
