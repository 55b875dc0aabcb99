# test-backend-ops on the CPU backend, against the CPU reference implementation, for the ops of
# the clover graph: cmake -DCLOVER_OPS=... -DTEST_BACKEND_OPS=... -DMODEL=clover.gguf -P this
#
# clover-ops lists the ops of a causal commit and of a commit fused with a block pass (block
# size 8): the clover-specific ones run (GATED_DELTA_NET, SSM_CONV, SOFTPLUS, CONCAT, PAD,
# SOFT_MAX, ARGSORT, ...; ~900 cases, ~30 s on two cores). Left out: the ops that only
# re-describe memory, and the generic ones that every llama.cpp model runs, whose cases are
# too many for the CI budget on two cores (measured here: MUL_MAT over 1,700 cases, FLASH_ATTN_EXT
# over 2,000, MUL_MAT_ID did not finish its 400 s, SET_ROWS over 700, CPY over 600, ROPE 471 in
# 50 s, GET_ROWS 241 in 33 s, CONT/ADD/MUL/SUB 8-15 s each); test-llama-archs decodes through
# all of them on every architecture.
set(generic_ops NONE VIEW RESHAPE PERMUTE TRANSPOSE
                MUL_MAT MUL_MAT_ID FLASH_ATTN_EXT SET_ROWS GET_ROWS CPY CONT ROPE ADD MUL SUB)

foreach(var CLOVER_OPS TEST_BACKEND_OPS MODEL)
    if(NOT DEFINED ${var})
        message(FATAL_ERROR "backend-ops-clover.cmake: -D${var}=... is required")
    endif()
endforeach()

execute_process(COMMAND "${CLOVER_OPS}" "${MODEL}" 8
                OUTPUT_VARIABLE out RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
    message(FATAL_ERROR "clover-ops ${MODEL} failed (${rc})")
endif()
string(STRIP "${out}" out)
string(REPLACE "\n" ";" ops "${out}")
list(REMOVE_ITEM ops ${generic_ops})
list(LENGTH ops n_ops)
if(n_ops LESS 5)
    message(FATAL_ERROR "clover-ops listed too few ops: '${out}'")
endif()
list(JOIN ops "," filter)

message(STATUS "test-backend-ops test -b CPU -o ${filter}")
execute_process(COMMAND "${TEST_BACKEND_OPS}" test -b CPU -o "${filter}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
    message(FATAL_ERROR "test-backend-ops failed (${rc})")
endif()
