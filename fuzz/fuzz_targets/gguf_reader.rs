//! Fuzz the GGUF reader: any bytes must give a file or an error, never a panic, an abort,
//! a huge allocation or a hang. A parsed file's tensor views and metadata accessors are
//! exercised too, since they trust what the parser checked.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memra_gguf::quant::{can_dequantize, dequantize};
use memra_gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let _ = f.metadata.architecture();
    for (k, v) in f.metadata.iter() {
        let _ = (k, v.to_string());
        let _ = f.metadata.get_str_array(k);
        let _ = f.metadata.get_i64_array(k);
        let _ = f.metadata.get_u32(k);
    }
    for t in &f.tensors {
        let bytes = f.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.size);
        // Decode the first block or so of each tensor.
        let n = t.ty.block_size().max(1);
        if can_dequantize(t.ty) && bytes.len() >= t.ty.type_size() {
            let mut out = vec![0f32; n];
            dequantize(t.ty, &bytes[..t.ty.type_size()], &mut out).unwrap();
        }
    }
});
