//! Custom kernels (JAX and Pallas functions exported to StableHLO by the Python package):
//! registration. The module is imported into a namespace named by a hash of its text, so
//! the same kernel traced in two processes has the same function names and its programs
//! the same cache keys; the rule that calls it is `lowering::rules::custom`.

use std::sync::Arc;

use lowering::rules::custom::{self, Kernel};

use crate::{Error, ErrorKind, Result, Runtime};

impl Runtime {
    /// Registers the generic-form StableHLO module `module` as kernel `name`; returns the
    /// id `torch_pjrt::jax_call` takes. Refuses custom calls this plugin cannot run.
    pub fn register_kernel(&self, name: &str, module: &str) -> Result<String> {
        use sha2::{Digest, Sha256};
        let h = Sha256::digest(module.as_bytes());
        let id: String = std::iter::once("jaxk_".to_string())
            .chain(h[..12].iter().map(|x| format!("{x:02x}")))
            .collect();
        if custom::get(&id).is_some() {
            return Ok(id);
        }
        let imported = stablehlo::import::import(module, &id)
            .map_err(|e| Error::new(ErrorKind::Value, format!("kernel '{name}': {e}")))?;
        let platform = self.client.platform_name();
        for target in &imported.custom_calls {
            if let Err(why) = custom_call_runs_on(target, &platform) {
                return Err(Error::new(
                    ErrorKind::NotImplemented,
                    format!(
                        "kernel '{name}' calls the custom call '{target}', which the {platform} \
                         PJRT plugin cannot run: {why}"
                    ),
                ));
            }
        }
        let text: Arc<str> = Arc::from(imported.text.as_str());
        custom::register(
            &id,
            Kernel {
                name: name.to_string(),
                module: imported,
                text,
            },
        );
        Ok(id)
    }

    /// A plugin attribute (`stablehlo_current_version`, `stablehlo_minimum_version`,
    /// `xla_version`) as text, None when the plugin does not report it.
    pub fn plugin_attribute(&self, name: &str) -> Result<Option<String>> {
        self.client
            .plugin()
            .attribute(name)
            .map_err(|e| Error::runtime(e.to_string()))
    }
}

/// Whether a custom call target can run on `platform` (the plugin's platform name), and
/// why not. XLA's own targets run anywhere; the others belong to one platform's runtime.
fn custom_call_runs_on(target: &str, platform: &str) -> std::result::Result<(), &'static str> {
    let gpu = matches!(platform, "cuda" | "rocm" | "gpu");
    if matches!(
        target,
        "Sharding"
            | "SPMDFullToShardShape"
            | "SPMDShardToFullShape"
            | "MoveToHost"
            | "MoveToDevice"
    ) {
        Ok(())
    } else if target == "tpu_custom_call" {
        if platform == "tpu" {
            Ok(())
        } else {
            Err("it is a Mosaic TPU kernel (a Pallas kernel lowered for TPU); off TPU, run Pallas kernels in interpret mode")
        }
    } else if target.starts_with("__gpu$")
        || target.starts_with("triton")
        || target.starts_with("mosaic_gpu")
        || target.starts_with("cu")
        || target.starts_with("hip")
    {
        if gpu {
            Ok(())
        } else {
            Err("it is a GPU kernel (Triton, Mosaic GPU or a CUDA library call)")
        }
    } else if target.starts_with("lapack_") || target.starts_with("ducc_") {
        Err("it is one of jaxlib's own CPU kernels, which XLA plugins do not have")
    } else if platform == "cpu" {
        Err("the XLA CPU plugin has no custom calls of its own")
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::custom_call_runs_on;

    #[test]
    fn custom_calls_belong_to_their_platform() {
        assert!(custom_call_runs_on("tpu_custom_call", "tpu").is_ok());
        assert!(custom_call_runs_on("tpu_custom_call", "cpu").is_err());
        assert!(custom_call_runs_on("triton_kernel_call", "cuda").is_ok());
        assert!(custom_call_runs_on("triton_kernel_call", "tpu").is_err());
        assert!(custom_call_runs_on("lapack_sgetrf_ffi", "cpu").is_err());
        assert!(custom_call_runs_on("Sharding", "cpu").is_ok());
        assert!(custom_call_runs_on("my_target", "cpu").is_err());
    }
}
