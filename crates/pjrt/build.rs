//! Compiles `csrc/pjrt_wrap.c` against the `pjrt_c_api.h` shipped in the
//! `xla-cpu-pjrt` wheel. No PJRT plugin is linked; it is dlopen'ed at run time.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const HEADER: &str = "pjrt_c_api.h";

const FIND_HEADER_PY: &str = r#"
import importlib.util, os, site, sys
def sub(p): return os.path.join(p, "xla_cpu_pjrt", "include")
try:
    spec = importlib.util.find_spec("xla_plugins")
    cands = [sub(p) for p in (spec.submodule_search_locations or [])] if spec else []
except Exception:
    cands = []
dirs = getattr(site, "getsitepackages", lambda: [])() + [site.getusersitepackages()] + sys.path
cands += [sub(os.path.join(d, "xla_plugins")) for d in dirs if d]
print(next((os.path.abspath(c) for c in cands if os.path.isfile(os.path.join(c, "pjrt_c_api.h"))), ""))
"#;

fn python_candidates(manifest_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for var in ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"] {
        if let Ok(p) = env::var(var) {
            if !p.is_empty() {
                out.push(p);
            }
        }
    }
    // Canonicalize the workspace dir, not the interpreter: the venv's python is
    // a symlink and must be run through the venv path to see its site-packages.
    let root = std::fs::canonicalize(manifest_dir.join("../.."));
    let venv = root
        .unwrap_or_else(|_| manifest_dir.join("../.."))
        .join(".venv/bin/python");
    if venv.exists() {
        out.push(venv.to_string_lossy().into_owned());
    }
    out.push("python3".to_string());
    out
}

fn find_include_dir(manifest_dir: &Path) -> Result<PathBuf, String> {
    if let Ok(dir) = env::var("PJRT_INCLUDE_DIR") {
        let dir = PathBuf::from(dir);
        if dir.join(HEADER).is_file() {
            return Ok(dir);
        }
        return Err(format!(
            "PJRT_INCLUDE_DIR={} has no {HEADER}",
            dir.display()
        ));
    }
    let mut tried = Vec::new();
    for py in python_candidates(manifest_dir) {
        match Command::new(&py).arg("-c").arg(FIND_HEADER_PY).output() {
            Ok(out) if out.status.success() => {
                let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
                if !s.is_empty() && Path::new(&s).join(HEADER).is_file() {
                    return Ok(PathBuf::from(s));
                }
                tried.push(format!("{py}: xla_plugins/xla_cpu_pjrt/include not found"));
            }
            Ok(out) => tried.push(format!("{py}: exited with {}", out.status)),
            Err(e) => tried.push(format!("{py}: {e}")),
        }
    }
    Err(format!(
        "could not find the PJRT C API header ({HEADER}).\n  Install it with: pip install xla-cpu-pjrt\n  \
         (into ./.venv, or the interpreter named by PYO3_PYTHON), or set PJRT_INCLUDE_DIR to the \
         directory holding {HEADER}.\n  Tried: {}",
        tried.join("; ")
    ))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/pjrt_wrap.c");
    println!("cargo:rerun-if-changed=csrc/pjrt_wrap.h");
    for var in ["PJRT_INCLUDE_DIR", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let include = match find_include_dir(&manifest_dir) {
        Ok(dir) => dir,
        Err(msg) => {
            eprintln!("error: {msg}");
            std::process::exit(1);
        }
    };
    println!("cargo:rerun-if-changed={}", include.join(HEADER).display());
    println!("cargo:include={}", include.display());

    cc::Build::new()
        .file("csrc/pjrt_wrap.c")
        .include("csrc")
        .include(&include)
        .std("gnu11")
        .warnings(true)
        .compile("pjrt_wrap");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-link-lib=dl");
    }
}
