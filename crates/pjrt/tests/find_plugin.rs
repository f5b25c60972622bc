//! Separate test binary: it mutates process environment variables.

use std::path::PathBuf;

#[test]
fn find_plugin_behaviour() {
    std::env::remove_var("TORCH_PJRT_PLUGIN");
    std::env::remove_var("TORCH_PJRT_SITE_PACKAGES");
    let e = pjrt::find_plugin(&[]).unwrap_err();
    assert!(e.message.contains("no PJRT plugin found"), "{e}");
    assert!(e.message.contains("pip install xla-cpu-pjrt"), "{e}");
    assert!(e.message.contains("TORCH_PJRT_PLUGIN="), "{e}");

    // A fake site-packages with only the CPU plugin.
    let dir = std::env::temp_dir().join(format!("pjrt-find-{}", std::process::id()));
    let cpu = dir.join("xla_plugins/xla_cpu_pjrt");
    std::fs::create_dir_all(&cpu).unwrap();
    std::fs::write(cpu.join("xla_cpu_pjrt.so"), b"").unwrap();
    let found = pjrt::find_plugin(&[PathBuf::from("/nonexistent"), dir.clone()]).unwrap();
    assert_eq!(found, cpu.join("xla_cpu_pjrt.so"));

    std::env::set_var("TORCH_PJRT_SITE_PACKAGES", &dir);
    assert_eq!(pjrt::find_plugin(&[]).unwrap(), cpu.join("xla_cpu_pjrt.so"));
    std::env::remove_var("TORCH_PJRT_SITE_PACKAGES");

    std::env::set_var("TORCH_PJRT_PLUGIN", dir.join("missing.so"));
    let e = pjrt::find_plugin(std::slice::from_ref(&dir)).unwrap_err();
    assert!(e.message.contains("missing.so"), "{e}");
    std::env::set_var("TORCH_PJRT_PLUGIN", cpu.join("xla_cpu_pjrt.so"));
    assert_eq!(pjrt::find_plugin(&[]).unwrap(), cpu.join("xla_cpu_pjrt.so"));
    std::env::remove_var("TORCH_PJRT_PLUGIN");
    let _ = std::fs::remove_dir_all(&dir);
}
