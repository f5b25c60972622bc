//! Compiles the C++ shim against the installed torch's headers and links it whole into the
//! extension (its registrations run from an explicit init, never static initialisers).

use std::path::PathBuf;
use std::process::Command;

fn python() -> String {
    for var in ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"] {
        if let Ok(p) = std::env::var(var) {
            return p;
        }
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    if venv.exists() {
        return venv.to_string_lossy().into_owned();
    }
    "python3".into()
}

fn main() {
    println!("cargo:rerun-if-changed=shim/shim.cpp");
    println!("cargo:rerun-if-changed=shim/autocast.cpp");
    println!("cargo:rerun-if-changed=shim/kineto.cpp");
    println!("cargo:rerun-if-changed=shim/tpu_abi.h");
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
    let py = python();
    let out = Command::new(&py)
        .args([
            "-c",
            "import os, torch; print(os.path.dirname(torch.__file__))",
        ])
        .output()
        .unwrap_or_else(|e| panic!("running {py} to find torch: {e}"));
    if !out.status.success() {
        panic!(
            "torch is not importable by {py}: install it (pip install torch==2.15.*) or set PYO3_PYTHON\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let torch = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim().to_string());
    let include = torch.join("include");
    let lib = torch.join("lib");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("shim/shim.cpp")
        .file("shim/autocast.cpp")
        .file("shim/kineto.cpp")
        .include(&include)
        .include(include.join("kineto"))
        .include("shim")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .flag("-fvisibility=hidden")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .cargo_metadata(false)
        .compile("tpushim");
    let out_dir = std::env::var("OUT_DIR").expect("OUT_DIR");
    println!("cargo:rustc-link-search=native={out_dir}");
    println!("cargo:rustc-link-lib=static:+whole-archive=tpushim");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    // Installed as site-packages/torch_pjrt/_C.*.so, next to site-packages/torch.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN/../torch/lib");
}
