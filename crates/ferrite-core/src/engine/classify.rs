//! Triton's classification extension: an output asked for with `classification: k` is answered as
//! its top `k` entries per batch row (all of it without a batch dim), each a BYTES element
//! `"value:index"`, or `"value:index:label"` when the output has labels (`label_filename`), highest
//! first. Floats are written as C's `%f` (Triton's `std::to_string`), integers as they are.

use crate::{DataType, Element, Error, Result, Tensor, TensorData};

/// Whether outputs of `datatype` can be classified.
pub fn classifiable(datatype: DataType) -> bool {
    !matches!(datatype, DataType::Bytes | DataType::Bool)
}

/// `t`'s rows (along dim 0 when `batched`) and the elements of each.
fn rows(t: &Tensor, batched: bool) -> (usize, usize) {
    let rows = if batched { t.shape.first().copied().unwrap_or(1) } else { 1 };
    (rows, t.element_count().checked_div(rows).unwrap_or(0))
}

/// How many classes `top_k` answers for `t`: `k` a row, or the row's length if smaller.
pub fn classes(t: &Tensor, k: usize, batched: bool) -> usize {
    let (rows, per_row) = rows(t, batched);
    rows.saturating_mul(k.min(per_row))
}

/// `t`'s top `k` per row (rows along dim 0 when `batched`) as a BYTES tensor of shape `[rows, k']`
/// (`[k']` without a batch dim), `k'` being `k` or the row's length if smaller.
pub fn top_k(t: &Tensor, k: usize, batched: bool, labels: Option<&[String]>) -> Result<Tensor> {
    if k == 0 {
        return Err(Error::invalid(format!("output '{}': classification must ask for at least 1 class", t.name)));
    }
    let values = numbers(t)?;
    let (rows, per_row) = rows(t, batched);
    let k = k.min(per_row);
    let integer = !t.datatype.is_float();
    let mut items = Vec::with_capacity(rows * k);
    for row in values.chunks(per_row.max(1)).take(rows) {
        // Highest first; ties in index order, NaN last.
        let first = |&a: &usize, &b: &usize| {
            row[b].partial_cmp(&row[a]).unwrap_or_else(|| row[a].is_nan().cmp(&row[b].is_nan())).then(a.cmp(&b))
        };
        let mut order: Vec<usize> = (0..row.len()).collect();
        // The top k found first, then only they sorted: a top 5 of a segmentation map's millions
        // of scores is a pass over them, not a sort of them all.
        if k < order.len() {
            order.select_nth_unstable_by(k, first);
            order.truncate(k);
        }
        order.sort_unstable_by(first);
        for &i in &order {
            let v = row[i];
            let mut s = if integer { format!("{}", v as i64) } else { format!("{v:.6}") };
            s.push_str(&format!(":{i}"));
            if let Some(label) = labels.and_then(|l| l.get(i)) {
                s.push(':');
                s.push_str(label);
            }
            items.push(bytes::Bytes::from(s));
        }
    }
    let shape = if batched { vec![rows, k] } else { vec![k] };
    Ok(Tensor::new(&t.name, DataType::Bytes, shape, TensorData::Strings(items)))
}

/// Every element of `t` as f64 (its classification order).
fn numbers(t: &Tensor) -> Result<Vec<f64>> {
    elements(t, |v| v)
}

/// Every element of a numeric tensor, read as f64 and converted by `to` (pipelines' steps read
/// f32 through it without a second pass).
pub(crate) fn elements<T>(t: &Tensor, to: impl Fn(f64) -> T) -> Result<Vec<T>> {
    let TensorData::Fixed(b) = &t.data else {
        return Err(Error::invalid(format!("output '{}' of type {} cannot be classified", t.name, t.datatype)));
    };
    if t.datatype == DataType::Bool {
        return Err(Error::invalid(format!("output '{}' of type BOOL cannot be classified", t.name)));
    }
    let size = t.datatype.size().unwrap_or(1);
    Ok(
        crate::dispatch!(t.datatype, T => b.chunks_exact(size).map(|c| to(T::read_le(c).to_f64())).collect(), bytes => unreachable!("BYTES data is never fixed")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(t: &Tensor) -> Vec<String> {
        let TensorData::Strings(v) = &t.data else { panic!() };
        v.iter().map(|b| String::from_utf8(b.to_vec()).unwrap()).collect()
    }

    #[test]
    fn top_k_per_row_in_tritons_format() {
        let t = Tensor::from_le("y", DataType::Fp32, vec![2, 4], &[0.1f32, 0.7, 0.2, 0.7, 3.0, -1.0, 2.5, 0.0]);
        let labels: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let out = top_k(&t, 2, true, Some(&labels)).unwrap();
        assert_eq!(out.shape, vec![2, 2]);
        assert_eq!(strings(&out), ["0.700000:1:b", "0.700000:3:d", "3.000000:0:a", "2.500000:2:c"]);
        let ints = Tensor::from_le("y", DataType::Int64, vec![3], &[5i64, 9, 7]);
        let out = top_k(&ints, 5, false, None).unwrap();
        assert_eq!((out.shape.clone(), strings(&out)), (vec![3], vec!["9:1".into(), "7:2".into(), "5:0".into()]));
        assert!(top_k(&t, 0, true, None).is_err());
    }

    #[test]
    fn the_top_k_of_a_long_row_is_its_sorted_head() {
        // Ties, NaN and negative zero among 10,000 scores: every k gives the head of the whole
        // row sorted highest first, ties in index order, NaN last.
        let row: Vec<f32> = (0..10_000u32)
            .map(|i| match i % 97 {
                0 => f32::NAN,
                1 => -0.0,
                _ => ((i.wrapping_mul(2_654_435_761) >> 20) % 50) as f32 / 7.0,
            })
            .collect();
        let t = Tensor::from_le("y", DataType::Fp32, vec![row.len()], &row);
        let mut sorted: Vec<usize> = (0..row.len()).collect();
        sorted.sort_by(|&a, &b| {
            let (x, y) = (row[a] as f64, row[b] as f64);
            y.partial_cmp(&x).unwrap_or_else(|| x.is_nan().cmp(&y.is_nan()))
        });
        for k in [1, 2, 5, 50, 9_999, 10_000, 20_000] {
            let got: Vec<usize> = strings(&top_k(&t, k, false, None).unwrap())
                .iter()
                .map(|s| s.rsplit(':').next().unwrap().parse().unwrap())
                .collect();
            assert_eq!(got, sorted[..k.min(row.len())], "k = {k}");
        }
    }
}
