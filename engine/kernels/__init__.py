"""Python wrappers that record each shaders/<op>.wgsl kernel into a Recorder."""
