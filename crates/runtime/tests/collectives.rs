//! XLA-native collectives (`rules/collectives.rs`): each rule's program compiled with one
//! replica on each of the CPU plugin's 4 devices and run by this one process, against the
//! values computed here.

use std::sync::Arc;

use lowering::{Arg, Args, Ctx, Out, TensorArg};
use pjrt::{Client, ElementType, Plugin};
use stablehlo::{Builder, DType, TensorType};

const DEVICES: [usize; 4] = [0, 1, 2, 3];

fn client() -> Arc<Client> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.venv/lib/python3.11/site-packages");
    let path = pjrt::find_plugin(&[root]).expect("plugin");
    let c = Client::new(Plugin::load(&path).expect("load")).expect("client");
    assert!(c.num_devices() >= 4, "the CPU plugin has 4 devices");
    c
}

/// The program of `op` on an input of `shape` (`dtype`) with `args`.
fn program(op: &str, dtype: DType, shape: &[i64], args: Vec<(&str, Arg)>) -> String {
    let mut b = Builder::new();
    let value = b.param(TensorType::new(dtype, shape));
    let input = TensorArg {
        value,
        dtype,
        shape: shape.to_vec(),
        wrapped_number: false,
    };
    let mut items = vec![("self".to_string(), Arg::Tensor(input))];
    items.extend(args.into_iter().map(|(n, a)| (n.to_string(), a)));
    let args = Args { items };
    let rule = lowering::rules::lookup(op).expect("a rule");
    let mut c = Ctx::new(&mut b, op, "", &args);
    let outs = rule(&mut c).expect("lowers");
    let [Out::T(r)] = outs.as_slice() else {
        panic!("one tensor result")
    };
    let r = *r;
    b.finish(&[r])
}

fn ints(v: &[i64]) -> Arg {
    Arg::List(v.iter().map(|x| Arg::Int(*x)).collect())
}

/// Runs `mlir` once per device, replica `r` reading `inputs[r]` (f32 of `shape`).
fn run_f32(c: &Client, mlir: &str, shape: &[i64], inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let exe = c.compile_replicated(mlir, &DEVICES).expect("compiles");
    let bufs: Vec<_> = inputs
        .iter()
        .zip(DEVICES)
        .map(|(v, d)| {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            c.buffer_from_host(&bytes, ElementType::F32, shape, d)
                .expect("upload")
        })
        .collect();
    let lists: Vec<Vec<_>> = bufs.iter().map(|b| vec![b]).collect();
    let outs = exe.execute_replicated(&lists).expect("runs");
    outs.iter()
        .zip(DEVICES)
        .map(|(o, d)| {
            assert_eq!(o[0].device(), d, "each replica's result on its device");
            o[0].to_host_vec()
                .expect("read")
                .chunks(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect()
}

/// Replica `r`'s input: 8 values, `r * 10 + i`.
fn inputs() -> Vec<Vec<f32>> {
    (0..4)
        .map(|r| (0..8).map(|i| (r * 10 + i) as f32).collect())
        .collect()
}

fn world() -> Vec<(&'static str, Arg)> {
    vec![("ranks", ints(&[0, 1, 2, 3])), ("group_size", Arg::Int(4))]
}

#[test]
fn all_reduce_sum_avg_max_and_subgroups() {
    let c = client();
    let x = inputs();
    for (op, f) in [
        ("sum", (|v: &[f32]| v.iter().sum()) as fn(&[f32]) -> f32),
        ("avg", |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32),
        ("max", |v: &[f32]| {
            v.iter().cloned().fold(f32::MIN, f32::max)
        }),
    ] {
        let mut args = world();
        args.push(("reduce_op", Arg::Str(op.into())));
        let mlir = program("torch_pjrt::all_reduce", DType::F32, &[8], args);
        let got = run_f32(&c, &mlir, &[8], &x);
        for (r, out) in got.iter().enumerate() {
            for (i, v) in out.iter().enumerate() {
                let col: Vec<f32> = x.iter().map(|row| row[i]).collect();
                assert_eq!(*v, f(&col), "{op}: replica {r}, element {i}");
            }
        }
    }
    // Two groups, {0, 2} and {1, 3}: each sums its own pair.
    let mut args = vec![("ranks", ints(&[0, 2, 1, 3])), ("group_size", Arg::Int(2))];
    args.push(("reduce_op", Arg::Str("sum".into())));
    let got = run_f32(
        &c,
        &program("torch_pjrt::all_reduce", DType::F32, &[8], args),
        &[8],
        &x,
    );
    for (r, out) in got.iter().enumerate() {
        let peer = r ^ 2;
        let want: Vec<f32> = (0..8).map(|i| x[r][i] + x[peer][i]).collect();
        assert_eq!(out, &want, "replica {r}");
    }
}

#[test]
fn all_gather_reduce_scatter_all_to_all_and_permute() {
    let c = client();
    let x = inputs();
    let gathered: Vec<f32> = x.concat();
    let got = run_f32(
        &c,
        &program("torch_pjrt::all_gather", DType::F32, &[8], world()),
        &[8],
        &x,
    );
    assert!(
        got.iter().all(|o| *o == gathered),
        "every replica gets all, in rank order"
    );

    let mut args = world();
    args.push(("reduce_op", Arg::Str("sum".into())));
    let got = run_f32(
        &c,
        &program("torch_pjrt::reduce_scatter", DType::F32, &[8], args),
        &[8],
        &x,
    );
    for (r, out) in got.iter().enumerate() {
        let want: Vec<f32> = (2 * r..2 * r + 2)
            .map(|i| x.iter().map(|row| row[i]).sum())
            .collect();
        assert_eq!(out, &want, "replica {r} keeps its piece of the sum");
    }

    let got = run_f32(
        &c,
        &program("torch_pjrt::all_to_all", DType::F32, &[8], world()),
        &[8],
        &x,
    );
    for (r, out) in got.iter().enumerate() {
        let want: Vec<f32> = (0..4)
            .flat_map(|s| x[s][2 * r..2 * r + 2].to_vec())
            .collect();
        assert_eq!(out, &want, "replica {r} gets piece {r} of every sender");
    }

    // A ring: r sends to r + 1.
    let pairs = ints(&[0, 1, 1, 2, 2, 3, 3, 0]);
    let mlir = program(
        "torch_pjrt::collective_permute",
        DType::F32,
        &[8],
        vec![("pairs", pairs)],
    );
    let got = run_f32(&c, &mlir, &[8], &x);
    for (r, out) in got.iter().enumerate() {
        assert_eq!(
            out,
            &x[(r + 3) % 4],
            "replica {r} gets its left neighbour's"
        );
    }
}

/// An op, its arguments besides the input, and a part of the error it must raise.
type Case<'a> = (&'a str, Vec<(&'a str, Arg)>, &'a str);

#[test]
fn bad_groups_and_reduce_ops_are_errors() {
    let mut b = Builder::new();
    let value = b.param(TensorType::new(DType::F32, &[6]));
    let t = Arg::Tensor(TensorArg {
        value,
        dtype: DType::F32,
        shape: vec![6],
        wrapped_number: false,
    });
    let cases: Vec<Case> = vec![
        (
            "torch_pjrt::all_reduce",
            vec![("ranks", ints(&[0, 1, 2])), ("group_size", Arg::Int(2))],
            "do not form groups",
        ),
        (
            "torch_pjrt::all_reduce",
            vec![
                ("ranks", ints(&[0, 1])),
                ("group_size", Arg::Int(2)),
                ("reduce_op", Arg::Str("bxor".into())),
            ],
            "not supported for Float",
        ),
        (
            "torch_pjrt::reduce_scatter",
            vec![("ranks", ints(&[0, 1, 2, 3])), ("group_size", Arg::Int(4))],
            "equal pieces",
        ),
    ];
    for (op, extra, want) in cases {
        let mut items = vec![("self".to_string(), t.clone())];
        items.extend(extra.into_iter().map(|(n, a)| (n.to_string(), a)));
        let args = Args { items };
        let mut c = Ctx::new(&mut b, op, "", &args);
        match lowering::rules::lookup(op).expect("rule")(&mut c) {
            Err(lowering::LowerError::User(_, m)) => assert!(m.contains(want), "{op}: {m}"),
            other => panic!("{op}: expected an error, got {other:?}"),
        }
    }
}

#[test]
fn replicated_runs_refuse_misplaced_or_missing_inputs() {
    let c = client();
    let mlir = program("torch_pjrt::all_gather", DType::F32, &[2], world());
    let exe = c.compile_replicated(&mlir, &DEVICES).expect("compiles");
    let bytes = [0u8; 8];
    let on = |d| {
        c.buffer_from_host(&bytes, ElementType::F32, &[2], d)
            .expect("upload")
    };
    let bufs: Vec<_> = [1, 0, 2, 3].into_iter().map(on).collect();
    let swapped: Vec<Vec<_>> = bufs.iter().map(|b| vec![b]).collect();
    let e = exe
        .execute_replicated(&swapped)
        .expect_err("replica 0's input is on device 1");
    assert!(
        e.message.contains("replica 0 is on device 1"),
        "{}",
        e.message
    );
    let e = exe
        .execute_replicated(&swapped[..3])
        .expect_err("3 lists for 4 replicas");
    assert!(
        e.message.contains("3 argument lists for 4 replicas"),
        "{}",
        e.message
    );
    let e = exe
        .execute(&[&bufs[1]])
        .expect_err("4 replicas, one argument list");
    assert!(e.message.contains("execute_replicated"), "{}", e.message);
    let e = c.compile_replicated(&mlir, &[]).expect_err("no device");
    assert!(e.message.contains("at least one device"), "{}", e.message);
}
