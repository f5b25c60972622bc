//! End-to-end tests against the CPU plugin from the `xla-cpu-pjrt` wheel.
//! The plugin path comes from TORCH_PJRT_PLUGIN or the workspace `.venv`.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use pjrt::{Buffer, Client, ElementType, Plugin};

const ADD: &str = "module {
  func.func public @main(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
    %0 = stablehlo.add %a, %b : tensor<4xf32>
    return %0 : tensor<4xf32>
  }
}";

fn plugin_path() -> PathBuf {
    if let Some(p) = std::env::var_os("TORCH_PJRT_PLUGIN") {
        return PathBuf::from(p);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/lib");
    let py = std::fs::read_dir(&venv)
        .ok()
        .and_then(|rd| {
            rd.filter_map(|e| e.ok())
                .find(|e| e.file_name().to_string_lossy().starts_with("python"))
        })
        .map(|e| e.path())
        .unwrap_or_else(|| venv.join("python3.11"));
    py.join("site-packages/xla_plugins/xla_cpu_pjrt/xla_cpu_pjrt.so")
}

fn client() -> Arc<Client> {
    static C: OnceLock<Arc<Client>> = OnceLock::new();
    C.get_or_init(|| {
        let plugin = Plugin::load(&plugin_path()).expect("load CPU plugin");
        Client::new(plugin).expect("create client")
    })
    .clone()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn to_f32(b: &Buffer) -> Vec<f32> {
    let bytes = b.to_host_vec().expect("to_host");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn upload(c: &Client, v: &[f32], device: usize) -> Buffer {
    c.buffer_from_host(&f32_bytes(v), ElementType::F32, &[v.len() as i64], device)
        .expect("upload")
}

#[test]
fn client_info() {
    let c = client();
    let (major, minor) = c.plugin().api_version();
    assert_eq!(major, 0);
    assert!(minor > 0);
    assert_eq!(c.platform_name(), "cpu");
    assert!(c.num_devices() >= 2, "expected several CPU devices");
    assert!(!c.device_kind(0).is_empty());
    assert_eq!(c.device_kind(usize::MAX), "");
    eprintln!(
        "plugin api {major}.{minor}, platform {} {:?}, {} devices, kind {:?}",
        c.platform_name(),
        c.platform_version(),
        c.num_devices(),
        c.device_kind(0)
    );
}

#[test]
fn add_roundtrip_and_latency() {
    let c = client();
    let t = Instant::now();
    let exe = c.compile(ADD, 0).expect("compile");
    let compile = t.elapsed();
    assert_eq!(exe.num_outputs(), 1);
    assert_eq!(exe.device(), 0);
    let a = upload(&c, &[1.0, 2.0, 3.0, 4.0], 0);
    let b = upload(&c, &[10.0, 20.0, 30.0, 40.0], 0);
    assert_eq!(a.dims(), vec![4]);
    assert_eq!(a.element_type(), ElementType::F32);
    assert_eq!(a.device(), 0);
    assert!(a.on_device_size_in_bytes().unwrap() >= 16);
    let out = exe.execute(&[&a, &b]).expect("execute");
    assert_eq!(out.len(), 1);
    out[0].ready().expect("ready");
    assert!(out[0].is_ready_nonblocking().unwrap());
    assert_eq!(out[0].dims(), vec![4]);
    assert_eq!(out[0].element_type(), ElementType::F32);
    assert_eq!(to_f32(&out[0]), vec![11.0, 22.0, 33.0, 44.0]);

    // Warm execute latency (enqueue + wait) and full round trip.
    let n = 200;
    let t = Instant::now();
    for _ in 0..n {
        let o = exe.execute(&[&a, &b]).unwrap();
        o[0].ready().unwrap();
    }
    let exec = t.elapsed() / n;
    let t = Instant::now();
    for _ in 0..n {
        let x = upload(&c, &[1.0, 2.0, 3.0, 4.0], 0);
        let o = exe.execute(&[&x, &b]).unwrap();
        let _ = to_f32(&o[0]);
    }
    let roundtrip = t.elapsed() / n;
    eprintln!("compile {compile:?}; execute+ready {exec:?}; upload+execute+to_host {roundtrip:?}");
}

#[test]
fn upload_validates_size_and_device() {
    let c = client();
    let e = c
        .buffer_from_host(&[0u8; 12], ElementType::F32, &[4], 0)
        .unwrap_err();
    assert_eq!(e.code, pjrt::code::INVALID_ARGUMENT);
    let e = c
        .buffer_from_host(&[0u8; 16], ElementType::F32, &[4], 999)
        .unwrap_err();
    assert!(e.message.contains("out of range"), "{e}");
    // Scalars and other types.
    let s = c
        .buffer_from_host(&7i64.to_le_bytes(), ElementType::S64, &[], 0)
        .unwrap();
    assert_eq!(s.dims(), Vec::<i64>::new());
    assert_eq!(s.to_host_vec().unwrap(), 7i64.to_le_bytes());
    let mut small = [0u8; 4];
    assert!(s.to_host(&mut small).is_err());
}

#[test]
fn bad_mlir_is_an_error() {
    let c = client();
    let e = c.compile("module { this is not mlir }", 0).unwrap_err();
    assert!(e.code != 0 && !e.message.is_empty(), "{e}");
    eprintln!("compile error: {e}");
}

#[test]
fn wrong_input_count_is_an_error() {
    let c = client();
    let exe = c.compile(ADD, 0).unwrap();
    let a = upload(&c, &[1.0; 4], 0);
    let e = exe.execute(&[&a]).unwrap_err();
    assert!(!e.message.is_empty());
    eprintln!("wrong input count: {e}");
}

#[test]
fn input_on_wrong_device_is_an_error() {
    let c = client();
    let exe = c.compile(ADD, 0).unwrap();
    let a = upload(&c, &[1.0; 4], 0);
    let b = upload(&c, &[1.0; 4], 1);
    assert!(exe.execute(&[&a, &b]).is_err());
}

#[test]
fn device_1_compile_and_run() {
    let c = client();
    let exe = c.compile(ADD, 1).expect("compile for device 1");
    assert_eq!(exe.device(), 1);
    let a = upload(&c, &[1.0, 2.0, 3.0, 4.0], 1);
    let b = upload(&c, &[1.0, 1.0, 1.0, 1.0], 1);
    assert_eq!(a.device(), 1);
    let out = exe.execute(&[&a, &b]).expect("execute on device 1");
    assert_eq!(out[0].device(), 1);
    assert_eq!(to_f32(&out[0]), vec![2.0, 3.0, 4.0, 5.0]);
}

#[test]
fn serialize_deserialize_roundtrip() {
    let c = client();
    let exe = c.compile(ADD, 0).unwrap();
    match exe.fingerprint() {
        Ok(f) => eprintln!("fingerprint: {f:?}"),
        Err(e) => eprintln!("fingerprint unavailable: {e}"),
    }
    let bytes = exe.serialize().expect("serialize");
    assert!(!bytes.is_empty());
    eprintln!("serialized executable: {} bytes", bytes.len());
    for dev in [0, 1] {
        let t = Instant::now();
        let exe2 = c.deserialize(&bytes, dev).expect("deserialize");
        eprintln!("deserialize onto device {dev}: {:?}", t.elapsed());
        assert_eq!(exe2.num_outputs(), 1);
        assert_eq!(exe2.device(), dev);
        let a = upload(&c, &[1.0, 2.0, 3.0, 4.0], dev);
        let b = upload(&c, &[4.0, 3.0, 2.0, 1.0], dev);
        let out = exe2.execute(&[&a, &b]).unwrap();
        assert_eq!(out[0].device(), dev);
        assert_eq!(to_f32(&out[0]), vec![5.0; 4]);
    }
    assert!(c.deserialize(b"garbage", 0).is_err());
}

#[test]
fn multiple_outputs_and_threads() {
    let c = client();
    let src = "module {
  func.func public @main(%a: tensor<2x3xf32>) -> (tensor<2x3xf32>, tensor<3x2xf32>) {
    %0 = stablehlo.multiply %a, %a : tensor<2x3xf32>
    %1 = stablehlo.transpose %a, dims = [1, 0] : (tensor<2x3xf32>) -> tensor<3x2xf32>
    return %0, %1 : tensor<2x3xf32>, tensor<3x2xf32>
  }
}";
    let exe = Arc::new(c.compile(src, 0).unwrap());
    assert_eq!(exe.num_outputs(), 2);
    let handles: Vec<_> = (0..4)
        .map(|k| {
            let (c, exe) = (c.clone(), exe.clone());
            std::thread::spawn(move || {
                let v: Vec<f32> = (0..6).map(|i| (i + k) as f32).collect();
                let a = c
                    .buffer_from_host(&f32_bytes(&v), ElementType::F32, &[2, 3], 0)
                    .unwrap();
                let out = exe.execute(&[&a]).unwrap();
                assert_eq!(out[0].dims(), vec![2, 3]);
                assert_eq!(out[1].dims(), vec![3, 2]);
                assert_eq!(to_f32(&out[0]), v.iter().map(|x| x * x).collect::<Vec<_>>());
                let t = to_f32(&out[1]);
                assert_eq!(t, vec![v[0], v[3], v[1], v[4], v[2], v[5]]);
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn plugin_load_errors() {
    let e = Plugin::load(std::path::Path::new("/nonexistent/plugin.so")).unwrap_err();
    assert!(e.message.contains("does not exist"));
    // A real shared library that is not a PJRT plugin.
    let libc = [
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/aarch64-linux-gnu/libc.so.6",
        "/usr/lib/libc.so.6",
    ]
    .iter()
    .map(std::path::Path::new)
    .find(|p| p.exists());
    if let Some(p) = libc {
        let e = Plugin::load(p).unwrap_err();
        assert!(e.message.contains("GetPjrtApi"), "{e}");
    }
}

/// Shape buckets keep a result in its padded shape (`Builder::forget_dynamic_sizes`): a value
/// whose dim XLA's padder knows to be dynamic leaves as a plain static buffer once the dim is
/// marked dynamic in a bounded type and then set to its bound. Set to the bound from a static
/// operand type, the result keeps its size metadata (the buffer is 4 bytes longer and no
/// program's static parameter takes it).
#[test]
fn a_dynamic_dim_set_to_its_bound_leaves_as_a_static_buffer() {
    let program = |operand: &str| {
        format!(
            "module {{
  func.func public @main(%x: tensor<16xf32>, %n: tensor<i32>) -> (tensor<16xf32>, tensor<f32>) {{
    %y = stablehlo.set_dimension_size %x, %n, dim = 0 : (tensor<16xf32>, tensor<i32>) -> tensor<16xf32>
    %z = stablehlo.add %y, %y : tensor<16xf32>
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %s = stablehlo.reduce(%z init: %zero) applies stablehlo.add across dimensions = [0] : (tensor<16xf32>, tensor<f32>) -> tensor<f32>
    %b = stablehlo.constant dense<16> : tensor<i32>
    {operand}
    %w = stablehlo.set_dimension_size %m, %b, dim = 0 : ({}, tensor<i32>) -> tensor<16xf32>
    return %w, %s : tensor<16xf32>, tensor<f32>
  }}
}}",
            if operand.is_empty() {
                "tensor<16xf32>"
            } else {
                "tensor<?xf32, #stablehlo.bounds<16>>"
            }
        )
    };
    let c = client();
    let xs: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let x = upload(&c, &xs, 0);
    let n = c
        .buffer_from_host(&5i32.to_le_bytes(), ElementType::S32, &[], 0)
        .unwrap();
    let bounded = "%m = stablehlo.set_dimension_size %z, %n, dim = 0 : (tensor<16xf32>, tensor<i32>) -> tensor<?xf32, #stablehlo.bounds<16>>";
    let exe = c.compile(&program(bounded), 0).expect("compile");
    let out = exe.execute(&[&x, &n]).unwrap();
    assert_eq!(out[0].unpadded_dims().unwrap(), vec![16]);
    // The real part, then padding (here the doubled rest: XLA computed it).
    assert_eq!(&to_f32(&out[0])[..5], &[0.0, 2.0, 4.0, 6.0, 8.0]);
    assert_eq!(to_f32(&out[1]), vec![20.0]);
    // It feeds a program's static parameter as it is.
    let again = exe.execute(&[&out[0], &n]).unwrap();
    assert_eq!(to_f32(&again[1]), vec![40.0]);
    // Without the bounded type: still dynamic.
    let plain = program("").replace("%m, %b", "%z, %b");
    let exe = c.compile(&plain, 0).expect("compile");
    let out = exe.execute(&[&x, &n]).unwrap();
    assert_eq!(out[0].unpadded_dims().unwrap(), vec![5]);
    assert!(exe.execute(&[&out[0], &n]).is_err());
}

#[test]
fn host_memory_views_share_bytes_without_copies() {
    let c = client();
    // A buffer's bytes are host memory on the CPU plugin: read them in place.
    let a = upload(&c, &[1.0, 2.0, 3.0, 4.0], 0);
    let p = a.device_pointer().expect("device pointer") as *const f32;
    // SAFETY: a ready flat f32[4] buffer, alive for this read.
    assert_eq!(
        unsafe { std::slice::from_raw_parts(p, 4) },
        &[1.0, 2.0, 3.0, 4.0]
    );

    // A buffer over memory we own: programs read it, the callback runs once on release.
    #[repr(align(64))]
    struct Aligned([f32; 4]);
    let mut mem = Box::new(Aligned([10.0, 20.0, 30.0, 40.0]));
    let released = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let r = released.clone();
    let view = c
        .view_host_memory(
            mem.0.as_mut_ptr().cast(),
            ElementType::F32,
            &[4],
            0,
            Box::new(move || {
                r.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }),
        )
        .expect("view");
    assert_eq!(view.device_pointer().unwrap() as *const f32, mem.0.as_ptr());
    let exe = c.compile(ADD, 0).unwrap();
    let out = exe.execute(&[&a, &view]).unwrap();
    assert_eq!(to_f32(&out[0]), vec![11.0, 22.0, 33.0, 44.0]);
    assert_eq!(released.load(std::sync::atomic::Ordering::SeqCst), 0);
    drop(view);
    assert_eq!(released.load(std::sync::atomic::Ordering::SeqCst), 1);
    drop(mem);
}
